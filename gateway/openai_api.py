"""OpenAI-compatible chat: `POST /v1/chat/completions` (also under the account path), `GET /v1/models`
and `GET /v1/models/{model}`.

Streaming sends `chat.completion.chunk`s: the first carries `delta.role`, then
`delta.content` pieces, then one with `finish_reason` ("stop" | "length") and an
empty delta, then, with `stream_options.include_usage`, one with `choices: []`
and `usage`, then `data: [DONE]`. Errors are OpenAI error objects, in-stream
as a final `data: {"error": {...}}`, with OpenAI's statuses (`envelopes.openai_status`),
so the official client raises the class OpenAI would: `NotFoundError` for an unknown
model, `BadRequestError` for a prompt plus `max_tokens` over the context or an invalid
or missing field (named in `param`). When the tenant's tokens per day lower
`max_tokens`, `finish_reason` is "length" and the response carries
`x-edgeserve-quota-capped-max-tokens` (`state.py`). A client that disconnects cancels its request,
streamed or not (`client_watch.py`). `logprobs` (with `top_logprobs` alternatives) puts
`logprobs.content` on the choice, or on each chunk for the tokens it brings (`logprobs.py`);
`frequency_penalty` / `presence_penalty` go to the worker's sampler. `response_format`
`json_object` / `json_schema` constrains decoding to the schema (`response_format.py`); a
cut output ends with `finish_reason` "length", as OpenAI's does (the client's `parse`
then raises `LengthFinishReasonError`). `tools` are rendered by the chat template and,
unless `tool_choice` is `none`, the output is parsed into `tool_calls` (`tools.py`):
streamed as `delta.tool_calls` (index, id, type and name, then argument fragments as they
arrive), with `finish_reason` "tool_calls" after a call; `required` and a named function
decode under a grammar of the family's call syntax (`tool_grammar.py`). With a reasoning
parser, think-block text is `message.reasoning_content` / `delta.reasoning_content`
(`chat_output.py`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from backend.errors import EdgeServeError, InvalidRequest
from backend.sampling_params import SamplingParams
from gateway.client_watch import collect_or_cancel
from gateway.envelopes import as_typed, error_headers, openai_error, openai_status
from gateway.generation import Delta, Done
from gateway.logprobs import chat_logprobs
from gateway.response_format import openai_grammar
from gateway.served_models import ServedModel
from gateway.schemas import ChatCompletionRequest, decode_body, plain_messages
from gateway.sse import sse_event, sse_response
from gateway.state import GatewayState
from gateway.tenants import PendingAuth
from gateway.chat_output import ChatOutput, chat_message
from gateway.reasoning_parsers import ReasoningParser
from gateway.tool_grammar import tool_choice_grammar
from gateway.tool_parsers import ToolParser
from gateway.tools import check_no_control_text, check_tools, finish_reason_with_tools, tool_choice_mode

__all__ = ["chat_completions", "list_models", "get_model"]

API = "openai"


def _error_response(exc: BaseException, state: GatewayState) -> JSONResponse:
    typed = as_typed(exc)
    state.metrics.count_request(API, typed.code)
    return _error_json(typed)


def _error_json(exc: EdgeServeError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(openai_error(exc), status_code=openai_status(exc),
                        headers={**error_headers(exc), **(headers or {})})


async def chat_completions(request: Request) -> Response:
    state: GatewayState = request.app.state.gateway
    pending: PendingAuth | None = None
    try:
        pending = await state.begin_auth_checked(request)  # its answer is awaited below, before any quota
        req = decode_body(await state.body(request), ChatCompletionRequest)
        model = state.catalog.resolve(req.model)
        tools = check_tools(req.tools) if req.tools else None
        tool_mode = tool_choice_mode(req.tool_choice, tools)
        messages = plain_messages(req.messages)
        if tools or any(m.get("tool_calls") for m in messages):
            specials = model.tokenizer.control_tokens
            check_no_control_text(tools, specials, "tools")
            check_no_control_text([m.get("tool_calls") for m in messages], specials, "messages")
        prompt_ids = await model.chat_prompt_ids_async(messages, tools, pending.cache_namespace())
        max_tokens = req.max_completion_tokens or req.max_tokens or model.max_model_len - len(prompt_ids)
        parsers = _Parsers(model, tools if tool_mode != "none" else None, prompt_ids)
        grammar = openai_grammar(req.response_format)
        if tool_mode in ("required", "named"):
            if grammar is not None:
                raise InvalidRequest("`response_format` cannot be combined with `tool_choice` `required` or a named "
                                     "function (the calls' grammar applies)", field="response_format")
            grammar = tool_choice_grammar(model.tool_parser, tools or [], req.tool_choice, model.tokenizer,
                                          many=req.parallel_tool_calls is not False, reasoning=parsers.think_markers,
                                          in_think=parsers.in_think)
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
                                top_p=req.top_p or 1.0, seed=req.seed, stop=req.stop_list,
                                frequency_penalty=req.frequency_penalty or 0.0,
                                presence_penalty=req.presence_penalty or 0.0,
                                logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                                grammar=grammar)
        tenant = await state.confirm_auth(pending, request)
        gen = await state.start_generation(request, API, tenant, model, prompt_ids, params,
                                           keep_special_ids=parsers.keep_special_ids, stream=req.stream)
    except Exception as exc:  # noqa: BLE001 - translated once, here
        return _error_response(exc if pending is None else await pending.first_error(exc), state)
    headers = state.response_headers(gen)
    chunk = _ChunkMaker(f"chatcmpl-{gen.request_id}", req.model)
    tokenizer = model.tokenizer
    if req.stream:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        first = [True]
        output = parsers.output()

        def event(delta: dict[str, Any], lp: dict[str, Any] | None = None, finish: str | None = None) -> bytes:
            if first[0]:
                delta, first[0] = {"role": "assistant", **delta}, False
            return sse_event(chunk.make([{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": lp}]))

        def on_delta(d: Delta) -> bytes:
            lp = None if d.logprobs is None else {"content": chat_logprobs(tokenizer, d.token_ids, d.logprobs)}
            if output is None:
                return event({"content": d.text}, lp)
            deltas = output.feed(d.text) or ([{"content": ""}] if lp is not None else [])
            return b"".join(event(delta, lp if i == 0 else None) for i, delta in enumerate(deltas))

        def on_done(d: Done) -> Iterable[bytes]:
            finish = d.finish_reason
            if output is not None:
                for delta in output.finish():
                    yield event(delta)
                finish = finish_reason_with_tools(finish, output.called)
            yield event({"content": ""} if first[0] else {}, None, finish)
            if include_usage:
                yield sse_event(chunk.make([], usage=d.usage.to_dict()))

        return sse_response(gen, state.config.keepalive_s, headers, on_delta=on_delta, on_done=on_done,
                            on_error=lambda e: sse_event(openai_error(e)))
    try:
        text, done = await collect_or_cancel(gen, request)
    except EdgeServeError as exc:
        await gen.aclose()
        return _error_json(exc, headers)
    logprobs = None
    if req.logprobs:
        logprobs = {"content": chat_logprobs(tokenizer, gen.token_ids, gen.logprobs) if gen.logprobs else []}
    message: dict[str, Any] = {"role": "assistant", "content": text}
    finish_reason = done.finish_reason
    if parsers.active:
        message = chat_message(parsers.reasoning(), parsers.tools(), text)
        finish_reason = finish_reason_with_tools(finish_reason, "tool_calls" in message)
    body = {"id": chunk.id, "object": "chat.completion", "created": chunk.created, "model": req.model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": logprobs}],
            "usage": done.usage.to_dict()}
    # metering finishes in the background: the answer does not wait for Redis
    return JSONResponse(body, headers=headers, background=BackgroundTask(gen.aclose))


class _Parsers:
    """The request's reasoning and tool-call parsers (either may be off) and what they need: the
    special tokens to keep in the text, whether the prompt opened a think block."""

    def __init__(self, model: ServedModel, tools: list[dict[str, Any]] | None, prompt_ids: list[int]) -> None:
        self.tool_class = model.tool_parser if tools else None
        self.reasoning_class = model.reasoning_parser
        self.tool_list = tools
        self.in_think = model.prompt_opens_think(prompt_ids)
        markers = (*(self.tool_class.MARKERS if self.tool_class else ()),
                   *(self.reasoning_class.markers() if self.reasoning_class else ()))
        self.keep_special_ids = model.tokenizer.special_ids_of(markers)

    @property
    def active(self) -> bool:
        return self.tool_class is not None or self.reasoning_class is not None

    @property
    def think_markers(self) -> tuple[str, str, bool] | None:
        cls = self.reasoning_class
        return None if cls is None else (cls.START, cls.END, cls.IMPLICIT_START)

    def reasoning(self) -> ReasoningParser | None:
        if self.reasoning_class is None:
            return None
        return self.reasoning_class(in_think=self.in_think,
                                    tool_start=self.tool_class.START if self.tool_class else None)

    def tools(self) -> ToolParser | None:
        return self.tool_class(self.tool_list) if self.tool_class else None

    def output(self) -> ChatOutput | None:
        """A fresh streamed splitter, or None when there is nothing to split."""
        return ChatOutput(self.reasoning(), self.tools()) if self.active else None


class _ChunkMaker:
    def __init__(self, completion_id: str, model: str) -> None:
        self.id, self.model, self.created = completion_id, model, int(time.time())

    def make(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                               "model": self.model, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out


async def list_models(request: Request) -> Response:
    state: GatewayState = request.app.state.gateway
    try:
        await state.tenant_of(request)
    except Exception as exc:  # noqa: BLE001
        return _error_response(exc, state)
    data = [_model_object(name, m) for m in state.catalog.models for name in m.names]
    return JSONResponse({"object": "list", "data": data})


async def get_model(request: Request) -> Response:
    """`GET /v1/models/{model}`: one served model or alias, as in the list; 404 `model_not_found`."""
    state: GatewayState = request.app.state.gateway
    try:
        await state.tenant_of(request)
        name = request.path_params["model"]
        model = state.catalog.resolve(name)
    except Exception as exc:  # noqa: BLE001
        return _error_response(exc, state)
    return JSONResponse(_model_object(name, model))


def _model_object(name: str, model: ServedModel) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "edgeserve", "root": model.name,
            "max_model_len": model.max_model_len}
