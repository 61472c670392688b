"""Workers AI-style REST: `POST /client/v4/accounts/{account_id}/ai/run/{model}` and usage.

    {"prompt": "..."} or {"messages": [...]}, max_tokens 256, temperature 0.6, top_p, top_k, seed, stream,
    repetition_penalty (0, 2], frequency_penalty and presence_penalty [-2, 2], response_format
    -> {"result": {"response": "...", "usage": {...}}, "success": true, "errors": [], "messages": []}

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

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from backend.errors import EdgeServeError, InvalidRequest, QuotaExceeded
from backend.sampling_params import SamplingParams
from gateway.client_watch import collect_or_cancel
from gateway.envelopes import as_typed, error_headers, workers_error, workers_success
from gateway.generation import Generation
from gateway.redis_keys import utc_day
from gateway.response_format import TRUNCATED_JSON_NOTICE, workers_grammar
from gateway.schemas import WorkersRunRequest, decode_body, plain_messages
from gateway.sse import SSE_HEADERS, sse_event, sse_stream
from gateway.state import GatewayState

__all__ = ["workers_run", "workers_usage", "workers_error_response"]

API = "workers"


def workers_error_response(exc: BaseException, state: GatewayState) -> JSONResponse:
    typed = as_typed(exc)
    state.metrics.requests.labels(API, str(typed.code)).inc()
    return JSONResponse(workers_error(typed), status_code=typed.http_status, headers=error_headers(typed))


async def workers_run(request: Request) -> Response:
    state: GatewayState = request.app.state.gateway
    try:
        tenant = await state.tenant_of(request)
        model = state.catalog.resolve(request.path_params["model"])
        req = decode_body(await state.body(request), WorkersRunRequest)
        if req.messages is not None:
            prompt_ids = await model.chat_prompt_ids_async(plain_messages(req.messages))
        elif req.raw:  # the client wrote its own template: its control tokens are meant
            prompt_ids = await model.raw_prompt_ids_async(req.prompt or "")
        else:
            prompt_ids = await model.chat_prompt_ids_async([{"role": "user", "content": req.prompt or ""}])
        params = SamplingParams(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p or 1.0,
                                top_k=req.top_k or 0, seed=req.seed,
                                repetition_penalty=req.repetition_penalty or 1.0,
                                frequency_penalty=req.frequency_penalty or 0.0,
                                presence_penalty=req.presence_penalty or 0.0,
                                grammar=workers_grammar(req.response_format))
        gen = await state.start_generation(request, API, tenant, model, prompt_ids, params)
    except Exception as exc:  # noqa: BLE001 - translated once, here
        return workers_error_response(exc, state)
    headers = state.response_headers(gen)
    if req.stream:
        return StreamingResponse(
            sse_stream(gen, state.config.keepalive_s,
                       on_delta=lambda d: sse_event({"response": d.text}),
                       on_done=lambda d: [sse_event({"response": "", "usage": d.usage.to_dict()})],
                       on_error=lambda e: sse_event(workers_error(e), event="error")),
            media_type="text/event-stream", headers={**SSE_HEADERS, **headers})
    return await _collect(gen, request, headers)


async def _collect(gen: Generation, request: Request, headers: dict[str, str]) -> JSONResponse:
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
    # metering finishes in the background: the answer does not wait for Redis
    return JSONResponse(workers_success({"response": response, "usage": done.usage.to_dict()}, notices),
                        headers=headers, background=BackgroundTask(gen.aclose))


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
