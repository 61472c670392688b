"""Workers AI-style REST: `POST /client/v4/accounts/{account_id}/ai/run/{model}` and usage.

    {"prompt": "..."} or {"messages": [...]}, max_tokens 256, temperature 0.6, top_p, top_k, seed, stream,
    repetition_penalty (0, 2], frequency_penalty and presence_penalty [-2, 2], response_format
    -> {"result": {"response": "...", "usage": {...}}, "success": true, "errors": [], "messages": []}

Tools (`tools`, Workers AI's `{"name", "description", "parameters"}` or OpenAI's
`{"type": "function", "function": {...}}`) are rendered by the chat template and the output
is read by the model family's tool parser (`tools.py`). The calls come back in Workers AI's
traditional function-calling shape, `result.tool_calls: [{"name", "arguments": {...}}]`
(arguments as an object, as Workers AI returns them; each also carries its `id`, so a later
`role: "tool"` message can answer it), beside `response` (the text outside calls). That is
the shape Workers AI documents for this route, so its clients read it unchanged. Streamed,
`response` events carry the text outside calls and the final event (with `usage`) carries
`tool_calls`: a call's arguments are an object, which has no fragments to stream.

JSON mode (`response_format` `json_object` / `json_schema`, `response_format.py`): decoding
follows the schema and, not streamed, `response` is the parsed JSON value, as Workers AI
returns it; when `max_tokens` cut it, `response` is the incomplete text and `messages`
says so (code `TRUNCATED_JSON_NOTICE`).
    stream: data: {"response": "..."} ... data: {"response": "", "usage": {...}}  data: [DONE]

Model names may carry slashes (`@cf/huggingface/smollm2-135m-instruct`), so the
route takes the rest of the path. Every error, before or during the stream, is
the Workers envelope. A `prompt` is wrapped in the chat template as one user
message, and control-token text in it stays text; only with `raw` is the prompt
encoded as written. A client that disconnects cancels its request, streamed or not.

When the tenant's tokens per day lower `max_tokens`, the response says so: a
`messages` entry `{"code": 3036, "message": "max_tokens lowered from N to M ..."}`
and, streamed or not, the header `x-edgeserve-quota-capped-max-tokens: M` (`state.py`).
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable
from typing import Any

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from backend.errors import EdgeServeError, InvalidRequest, QuotaExceeded
from backend.sampling_params import SamplingParams
from gateway.client_watch import collect_or_cancel
from gateway.envelopes import as_typed, error_headers, workers_error, workers_success
from gateway.chat_output import chat_message
from gateway.generation import Delta, Done, Generation
from gateway.redis_keys import utc_day
from gateway.response_format import TRUNCATED_JSON_NOTICE, workers_grammar
from gateway.schemas import WorkersRunRequest, decode_body, plain_messages
from gateway.sse import sse_event, sse_response
from gateway.state import GatewayState
from gateway.tenants import PendingAuth
from gateway.tool_parsers import ToolParser
from gateway.tools import ToolCallStream, check_no_control_text, workers_tool_calls, workers_tools

__all__ = ["workers_run", "workers_usage", "workers_error_response"]

API = "workers"


def workers_error_response(exc: BaseException, state: GatewayState) -> JSONResponse:
    typed = as_typed(exc)
    state.metrics.count_request(API, typed.code)
    return JSONResponse(workers_error(typed), status_code=typed.http_status, headers=error_headers(typed))


async def workers_run(request: Request) -> Response:
    state: GatewayState = request.app.state.gateway
    pending: PendingAuth | None = None
    try:
        pending = await state.begin_auth_checked(request)  # its answer is awaited below, before any quota
        model = state.catalog.resolve(request.path_params["model"])
        req = decode_body(await state.body(request), WorkersRunRequest)
        tools = workers_tools(req.tools) if req.tools else None
        messages = plain_messages(req.messages) if req.messages is not None else None
        if tools or any(m.get("tool_calls") for m in messages or []):
            specials = model.tokenizer.control_tokens
            check_no_control_text(tools, specials, "tools")
            check_no_control_text([m.get("tool_calls") for m in messages or []], specials, "messages")
        namespace = pending.cache_namespace()
        if messages is not None:
            prompt_ids = await model.chat_prompt_ids_async(messages, tools, namespace)
        elif req.raw:  # the client wrote its own template: its control tokens are meant
            prompt_ids = await model.raw_prompt_ids_async(req.prompt or "", namespace)
        else:
            prompt_ids = await model.chat_prompt_ids_async([{"role": "user", "content": req.prompt or ""}], tools,
                                                           namespace)
        params = SamplingParams(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p or 1.0,
                                top_k=req.top_k or 0, seed=req.seed,
                                repetition_penalty=req.repetition_penalty or 1.0,
                                frequency_penalty=req.frequency_penalty or 0.0,
                                presence_penalty=req.presence_penalty or 0.0,
                                grammar=workers_grammar(req.response_format))
        keep = model.tokenizer.special_ids_of(model.tool_parser.MARKERS) if tools else frozenset()
        tenant = await state.confirm_auth(pending, request)
        gen = await state.start_generation(request, API, tenant, model, prompt_ids, params, keep_special_ids=keep,
                                           stream=req.stream)
    except Exception as exc:  # noqa: BLE001 - translated once, here
        return workers_error_response(exc if pending is None else await pending.first_error(exc), state)
    headers = state.response_headers(gen)
    parser = (lambda: model.tool_parser(tools)) if tools else None
    if req.stream:
        on_delta, on_done = _stream_handlers(parser)
        return sse_response(gen, state.config.keepalive_s, headers, on_delta=on_delta, on_done=on_done,
                            on_error=lambda e: sse_event(workers_error(e), event="error"))
    return await _collect(gen, request, headers, parser)


def _stream_handlers(parser: Callable[[], ToolParser] | None
                     ) -> tuple[Callable[[Delta], bytes], Callable[[Done], list[bytes]]]:
    """SSE handlers: text as `response` events; with tools, only the text outside calls, and the
    calls (read from the whole output) in the final event."""
    if parser is None:
        return (lambda d: sse_event({"response": d.text}),
                lambda d: [sse_event({"response": "", "usage": d.usage.to_dict()})])
    stream, whole = ToolCallStream(parser()), []

    def text_of(deltas: list[dict[str, Any]]) -> str:
        return "".join(d.get("content") or "" for d in deltas)

    def on_delta(d: Delta) -> bytes:
        whole.append(d.text)
        text = text_of(stream.feed(d.text))
        return sse_event({"response": text}) if text else b""

    def on_done(d: Done) -> list[bytes]:
        tail = text_of(stream.finish())
        calls = workers_tool_calls(chat_message(None, parser(), "".join(whole)))
        return [*([sse_event({"response": tail})] if tail else []),
                sse_event({"response": "", "tool_calls": calls, "usage": d.usage.to_dict()})]

    return on_delta, on_done


async def _collect(gen: Generation, request: Request, headers: dict[str, str],
                   parser: Callable[[], ToolParser] | None) -> JSONResponse:
    try:
        text, done = await collect_or_cancel(gen, request)
    except EdgeServeError as exc:
        await gen.aclose()
        return JSONResponse(workers_error(exc), status_code=exc.http_status, headers={**error_headers(exc), **headers})
    response: object = text
    notices = _notices(gen)
    if gen.params.grammar is not None:
        if done.finish_reason == "length":
            notices.append({"code": TRUNCATED_JSON_NOTICE,
                            "message": "max_tokens cut the JSON output: response is its incomplete text"})
        else:
            try:
                response = json.loads(text)
            except ValueError:  # a stop string ended it early: the text, as generated
                pass
    result: dict[str, Any] = {"response": response, "usage": done.usage.to_dict()}
    if parser is not None:
        message = chat_message(None, parser(), text)
        result["response"], result["tool_calls"] = message["content"] or "", workers_tool_calls(message)
    # metering finishes in the background: the answer does not wait for Redis
    return JSONResponse(workers_success(result, notices), headers=headers, background=BackgroundTask(gen.aclose))


def _notices(gen: Generation) -> list[dict[str, object]]:
    """The envelope's `messages`: whether the day's token quota lowered `max_tokens`."""
    if not gen.capped_by_quota:
        return []
    return [{"code": QuotaExceeded.code,
             "message": f"max_tokens lowered from {gen.requested_max_tokens} to {gen.params.max_tokens}: "
                        "that is what the account's daily token quota has left after the prompt"}]


async def workers_usage(request: Request) -> Response:
    """`GET /client/v4/accounts/{account_id}/ai/usage?from=YYYY-MM-DD&to=YYYY-MM-DD` (the caller's own)."""
    state: GatewayState = request.app.state.gateway
    try:
        tenant = await state.tenant_of(request)
        today = utc_day()
        start = request.query_params.get("from", today)
        end = request.query_params.get("to", today)
        for name, day in (("from", start), ("to", end)):
            try:
                datetime.date.fromisoformat(day)
            except ValueError:
                raise InvalidRequest(f"`{name}` must be a day YYYY-MM-DD, got {day!r}", field=name) from None
        days = await state.meter.usage(tenant.id, start, end)
    except Exception as exc:  # noqa: BLE001
        return workers_error_response(exc, state)
    return JSONResponse(workers_success({"account_id": tenant.id, "from": start, "to": end, "days": days}))
