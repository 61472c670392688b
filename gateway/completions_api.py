"""OpenAI legacy completions: `POST /v1/completions` (also under the account path).

What scoring clients (lm-evaluation-harness's `local-completions`) call:

    {"model", "prompt": str | [str] | [int] | [[int]], "max_tokens": 16, "echo", "logprobs": N,
     "temperature", "top_p", "stop", "seed", "frequency_penalty", "presence_penalty", "stream"}
    -> {"object": "text_completion", "choices": [{"index", "text", "logprobs", "finish_reason"}], "usage"}

Each prompt is its own generation (quota, route, metering), all admitted before the
answer starts and run concurrently; choice `index` follows the prompts' order and
`usage` sums them. A string prompt is encoded as written (control tokens kept, no
chat template); token ids go to the worker as given. `echo` puts the prompt before
the completion; with `logprobs` N its tokens come first in `logprobs`, the first one's
null (`gateway/logprobs.py`); `max_tokens` 0 with echo scores the prompt only (the
lm-eval loglikelihood request). Prompt logprobs are computed by the worker on the
paged prefill path (`backend/logprobs.py`).

Streaming sends `text_completion` chunks choice by choice (each prompt's echo, its
text pieces, then one with its `finish_reason`), then with
`stream_options.include_usage` one with `choices: []` and `usage`, then `data: [DONE]`.
Errors are OpenAI error objects, as in chat (`openai_api.py`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from backend.errors import EdgeServeError
from backend.protocol import Logprobs
from backend.sampling_params import SamplingParams
from gateway.client_watch import collect_or_cancel
from gateway.envelopes import as_typed, error_headers, openai_error, openai_status
from gateway.generation import Delta, Done, Generation, Usage
from gateway.logprobs import completion_logprobs, join_completion_logprobs
from gateway.schemas import CompletionRequest, decode_body
from gateway.served_models import ServedModel
from gateway.sse import DONE, KEEPALIVE, SSEResponse, sse_event
from gateway.state import GatewayState
from gateway.tenants import PendingAuth

__all__ = ["completions"]

API = "openai"


def _error_json(exc: EdgeServeError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(openai_error(exc), status_code=openai_status(exc),
                        headers={**error_headers(exc), **(headers or {})})


def _params(req: CompletionRequest) -> SamplingParams:
    scoring = req.echo and req.logprobs is not None
    return SamplingParams(
        max_tokens=req.max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
        top_p=req.top_p or 1.0, seed=req.seed, stop=req.stop_list,
        frequency_penalty=req.frequency_penalty or 0.0, presence_penalty=req.presence_penalty or 0.0,
        logprobs=req.logprobs,
        # the engine needs something to return when nothing is generated: the prompt's scores
        prompt_logprobs=req.logprobs if scoring else (0 if req.max_tokens == 0 else None))


async def _prompt_ids(model: ServedModel, prompt: str | list[int], cache_namespace: str | None) -> list[int]:
    if isinstance(prompt, str):
        return await model.raw_prompt_ids_async(prompt, cache_namespace)
    return model.check_length(list(prompt))


class _Choice:
    """One prompt's generation and what its choice shows (echo, logprobs)."""

    def __init__(self, index: int, gen: Generation, req: CompletionRequest, model: ServedModel,
                 prompt: str | list[int]) -> None:
        self.index, self.gen, self.req, self.tokenizer = index, gen, req, model.tokenizer
        self.prompt_text = prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt,
                                                                                        skip_special_tokens=False)
        self.offset = len(self.prompt_text) if req.echo else 0  # text_offset of the next generated token

    def echo(self) -> tuple[str, dict[str, Any] | None]:
        """The echoed prompt and its logprobs (call once the first item has arrived)."""
        if self.req.logprobs is None:
            return self.prompt_text, None
        lp = self.gen.prompt_logprobs or Logprobs([])
        return self.prompt_text, completion_logprobs(self.tokenizer, self.gen.prompt_ids, lp, first_is_null=True)

    def logprobs(self, token_ids: tuple[int, ...] | list[int], lp: Logprobs | None) -> dict[str, Any] | None:
        if self.req.logprobs is None:
            return None
        out = completion_logprobs(self.tokenizer, token_ids, lp or Logprobs([]), text_offset=self.offset)
        self.offset += sum(len(t) for t in out["tokens"])
        return out

    def whole(self, text: str, done: Done) -> dict[str, Any]:
        """The choice of a non-streamed answer."""
        lp = self.logprobs(self.gen.token_ids, self.gen.logprobs)
        if self.req.echo:
            prompt_text, prompt_lp = self.echo()
            text = prompt_text + text
            lp = join_completion_logprobs(prompt_lp, lp) if prompt_lp is not None and lp is not None else lp
        return {"index": self.index, "text": text, "logprobs": lp, "finish_reason": done.finish_reason}


async def completions(request: Request) -> Response:
    state: GatewayState = request.app.state.gateway
    choices: list[_Choice] = []
    pending: PendingAuth | None = None
    try:
        pending = await state.begin_auth_checked(request)  # its answer is awaited below, before any quota
        req = decode_body(await state.body(request), CompletionRequest)
        model = state.catalog.resolve(req.model)
        prompts = req.prompts()
        ids = [await _prompt_ids(model, p, pending.cache_namespace()) for p in prompts]
        tenant = await state.confirm_auth(pending, request)
        for i, (prompt, prompt_ids) in enumerate(zip(prompts, ids)):
            gen = await state.start_generation(request, API, tenant, model, prompt_ids, _params(req),
                                               stream=req.stream)
            choices.append(_Choice(i, gen, req, model, prompt))
    except Exception as exc:  # noqa: BLE001 - translated once, here
        for c in choices:
            await c.gen.aclose()
        typed = as_typed(exc if pending is None else await pending.first_error(exc))
        state.metrics.count_request(API, typed.code)
        return _error_json(typed)
    headers = state.response_headers(choices[0].gen)
    cid, created = f"cmpl-{choices[0].gen.request_id}", int(time.time())

    def body(choice_list: list[dict[str, Any]], usage: Usage | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": cid, "object": "text_completion", "created": created, "model": req.model,
                               "choices": choice_list}
        if usage is not None:
            out["usage"] = usage.to_dict()
        return out

    async def close_all() -> None:
        for c in choices:
            await c.gen.aclose()

    if req.stream:  # metering finishes after the last byte (`sse.py`)
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        return SSEResponse(_stream(choices, state.config.keepalive_s, body, include_usage), headers, after=close_all)
    results: list[dict[str, Any]] = []
    dones: list[Done] = []
    try:
        for c in choices:  # each runs meanwhile; collected in order
            text, done = await collect_or_cancel(c.gen, request)
            results.append(c.whole(text, done))
            dones.append(done)
    except EdgeServeError as exc:
        for c in choices:
            await c.gen.aclose()
        return _error_json(exc, headers)
    # metering finishes in the background: the answer does not wait for Redis
    return JSONResponse(body(results, _total(dones)), headers=headers, background=BackgroundTask(close_all))


def _total(dones: list[Done]) -> Usage:
    return Usage(sum(d.usage.prompt_tokens for d in dones), sum(d.usage.completion_tokens for d in dones),
                 sum(d.usage.cached_tokens for d in dones))


async def _stream(choices: list[_Choice], keepalive_s: float, body: Any, include_usage: bool) -> AsyncIterator[bytes]:
    """SSE bytes, choice after choice; closing it before its end (client gone) cancels every generation
    (after the end, the response's background task awaits their metering)."""
    dones: list[Done] = []
    ended = False
    try:
        for c in choices:
            first = True
            while True:
                item = await c.gen.next_item(keepalive_s)
                if item is None:
                    yield KEEPALIVE
                    continue
                if isinstance(item, EdgeServeError):
                    yield sse_event(openai_error(item))
                    return
                if first and c.req.echo:
                    text, lp = c.echo()
                    yield sse_event(body([{"index": c.index, "text": text, "logprobs": lp, "finish_reason": None}]))
                first = False
                if isinstance(item, Delta):
                    yield sse_event(body([{"index": c.index, "text": item.text,
                                           "logprobs": c.logprobs(item.token_ids, item.logprobs),
                                           "finish_reason": None}]))
                    continue
                dones.append(item)
                yield sse_event(body([{"index": c.index, "text": "", "logprobs": None,
                                       "finish_reason": item.finish_reason}]))
                break
        ended = True
        tail = sse_event(body([], _total(dones))) if include_usage else b""
        yield tail + DONE
    finally:
        if not ended:
            for c in choices:
                await c.gen.aclose()
