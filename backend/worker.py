"""Internal worker HTTP API (Starlette): generate, prefill, cancel, health, stats.

    POST /v1/generate          GenerateRequest (JSON) -> NDJSON stream of events
    POST /v1/prefill           PrefillRequest -> KV frames (roles prefill and unified; `prefill_server.py`)
    POST /v1/cancel/{id}       ends a request at the next step boundary
    GET  /health               {"status", "role", "model"}
    GET  /stats                running, waiting, pages used/free, bytes per token, counters (JSON)
    GET  /metrics              the same as Prometheus metrics

Errors found before the stream starts (bad JSON, bad sampling parameters,
prompt too long, queue full, wrong model) answer with their HTTP status and a
JSON body `{"error": {"code", "type", "message", ...}}`. Once streaming, a
failure arrives as an `error` event. A client that disconnects cancels its
request; its pages return at the next step.

Roles: `unified` runs both phases; `prefill` serves /v1/prefill for decode workers;
`decode` answers /v1/generate by fetching each prompt's KV from a prefill worker
(`decode_coordinator.py`) and decoding it here. A worker with prefix caching and a
KV-event publisher reports the blocks it stores and evicts to Redis; with a
heartbeat it registers itself (role, region, live load) for gateways' routers.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from backend.async_engine import AsyncEngine
from backend.decode_coordinator import DecodeCoordinator
from backend.prefill_server import prefill_endpoint
from backend.transfer_stats import TransferStats
from backend.errors import EdgeServeError, InvalidRequest, ModelNotFound
from backend.worker_metrics import CONTENT_TYPE, render_metrics, worker_registry
from backend.protocol import GenerateRequest, encoder

__all__ = ["create_worker_app", "NDJSON"]

NDJSON = "application/x-ndjson"
_request_decoder = msgspec.json.Decoder(GenerateRequest)


def _error_response(exc: EdgeServeError) -> JSONResponse:
    return JSONResponse({"error": exc.to_dict()}, status_code=exc.http_status)


def create_worker_app(engine: AsyncEngine, model_name: str, role: str = "unified",
                      coordinator: DecodeCoordinator | None = None,
                      background: Sequence[Callable[[], Coroutine[Any, Any, None]]] = ()) -> Starlette:
    """The worker's ASGI app, serving `engine` under the name `model_name` in `role`. `background`
    coroutines (the registry heartbeat, the KV-event publisher) run for the app's lifetime."""
    if (role == "decode") != (coordinator is not None):
        raise ValueError("a decode worker needs a DecodeCoordinator, and only a decode worker takes one")
    prefill_stats = TransferStats()

    async def generate(request: Request) -> Response:
        try:
            req = _request_decoder.decode(await request.body())
        except msgspec.ValidationError as exc:
            return _error_response(InvalidRequest(f"invalid generate request: {exc}"))
        except msgspec.DecodeError as exc:
            return _error_response(InvalidRequest(f"malformed JSON: {exc}"))
        if req.model is not None and req.model != model_name:
            return _error_response(ModelNotFound(f"model {req.model!r} is not served here; this worker serves "
                                                 f"{model_name!r}", model=req.model))
        try:  # typed refusals surface here, before any byte is sent; then headers go out at once
            stream = (coordinator.submit(req) if coordinator is not None else
                      engine.submit(req.prompt_ids, req.params, req.request_id, cache_salt=req.cache_salt))
        except EdgeServeError as exc:
            return _error_response(exc)

        async def body() -> AsyncIterator[bytes]:
            async with contextlib.aclosing(stream):  # closing aborts the request if it is not done
                async for ev in stream:
                    yield encoder.encode(ev) + b"\n"

        return StreamingResponse(body(), media_type=NDJSON)

    async def cancel(request: Request) -> Response:
        await engine.abort(request.path_params["request_id"])
        return JSONResponse({"cancelled": request.path_params["request_id"]})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "role": role, "model": model_name})

    async def stats(request: Request) -> Response:
        transfer = coordinator.stats if coordinator is not None else prefill_stats
        return JSONResponse({"role": role, "model": model_name, **engine.engine.snapshot(),
                             "kv_transfer": transfer.snapshot()})

    registry = worker_registry(engine.engine, model_name, role)

    async def metrics(request: Request) -> Response:
        return Response(render_metrics(registry), media_type=CONTENT_TYPE)

    routes = [
        Route("/v1/generate", generate, methods=["POST"]),
        Route("/v1/cancel/{request_id}", cancel, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/stats", stats, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    if role in ("prefill", "unified"):
        routes.append(Route("/v1/prefill", prefill_endpoint(engine, prefill_stats), methods=["POST"]))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        engine.start()
        tasks = [asyncio.create_task(run()) for run in background]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            engine.shutdown()

    return Starlette(routes=routes, lifespan=lifespan)

