"""Internal worker HTTP API (Starlette): generate, prefill, cancel, health, stats.

    POST /v1/generate          GenerateRequest (JSON) -> NDJSON stream of events
    POST /v1/prefill           PrefillRequest -> KV frames (roles prefill and unified; `prefill_server.py`)
    POST /v1/cancel/{id}       CancelRequest {"cancel_key"}: ends the request at the next step boundary
    GET  /health               {"status", "role", "model"}: 200 "ok"; 503 "draining" or "failed"
    GET  /stats                running, waiting, pages used/free, bytes per token, counters (JSON)
    GET  /metrics              the same as Prometheus metrics

Errors found before the stream starts (bad JSON, bad sampling parameters,
prompt too long, queue full, wrong model) answer with their HTTP status and a
JSON body `{"error": {"code", "type", "message", ...}}`. Once streaming, a
failure arrives as an `error` event. A client that disconnects cancels its
request, also one that leaves before the first byte (`closing_response.py`); its
pages return at the next step.

The worker token (`worker_auth.py`). Every route but /health needs
`Authorization: Bearer <token>` when the worker has a token; a missing or wrong one
is a 401 `AuthenticationError` (compared in constant time). Where the token comes
from: `--worker-token` or `$EDGESERVE_WORKER_TOKEN` for `edgeserve serve`,
`edgeserve gateway` and `edgeserve up` (`up` makes a random one and hands it to its
worker through the environment, never argv). Gateways send it on generate, cancel
and stats; decode workers send it to prefill workers on /v1/prefill. A worker
without a token serves anyone: `edgeserve serve` allows that only on loopback
(with a warning), elsewhere only with `--insecure-no-worker-token`. `cache_salt`,
`request_id` and `prefill_url` are therefore trusted only from token holders, and
two more checks hold even for them:

- cancel is scoped to the caller that started the request: `GenerateRequest.cancel_key`
  (a random secret; `WorkerClient` sets one) must be presented to /v1/cancel, else
  400 and nothing is cancelled. A request started without a key cannot be cancelled
  by id (closing its stream still ends it);
- a decode worker fetches KV only from one of its `--prefill-worker` URLs or a live
  prefill worker registered for its model (`DecodeCoordinator.check_prefill_url`);
  any other `prefill_url` is a 400 before any connection is made.

Lifecycle: a heartbeat (`registration`) runs for the app's lifetime and is stopped
(its record withdrawn) when the engine thread dies (/health turns 503 "failed" and
every waiting request ends with `EngineStopped`) or when a drain starts
(`app.state.drain`, `drain.py`: new work is refused with 503 `Draining`, in-flight
requests finish up to the drain timeout, the rest end with `Draining`). Request
headers are limited (`http_limits.py`, 431).

Roles: `unified` runs both phases; `prefill` serves /v1/prefill for decode workers;
`decode` answers /v1/generate by fetching each prompt's KV from a prefill worker
(`decode_coordinator.py`) and decoding it here. A worker with prefix caching and a
KV-event publisher reports the blocks it stores and evicts to Redis; with a
heartbeat it registers itself (role, region, live load) for gateways' routers.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Scope

from backend.async_engine import AsyncEngine
from backend.closing_response import ClosingStreamingResponse
from backend.decode_coordinator import DecodeCoordinator
from backend.drain import Drain, DrainGate
from backend.errors import Draining, EdgeServeError, EngineStopped, InvalidRequest, ModelNotFound
from backend.event_frames import ndjson_frames
from backend.http_limits import HeaderLimitMiddleware, HeaderLimits
from backend.prefill_server import prefill_endpoint
from backend.protocol import CancelRequest, GenerateRequest
from backend.transfer_stats import TransferStats
from backend.worker_auth import WorkerAuth
from backend.worker_metrics import CONTENT_TYPE, render_metrics, worker_registry

__all__ = ["create_worker_app", "worker_error_response", "NDJSON"]

log = logging.getLogger(__name__)

NDJSON = "application/x-ndjson"
ADMITTING = frozenset({"/v1/generate", "/v1/prefill"})  # new work: refused while draining
ENGINE_WATCH_S = 0.1
_request_decoder = msgspec.json.Decoder(GenerateRequest)
_cancel_decoder = msgspec.json.Decoder(CancelRequest)

Background = Callable[[], Coroutine[Any, Any, None]]


def worker_error_response(path: str, exc: EdgeServeError, status: int | None = None) -> JSONResponse:
    """The worker's error form, `{"error": {"code", "type", "message", ...}}` (Retry-After on 503s)."""
    status = status or exc.http_status
    headers = {"retry-after": str(int(exc.details.get("retry_after_s", 1)))} if status == 503 else None
    return JSONResponse({"error": exc.to_dict()}, status_code=status, headers=headers)


def _error_response(exc: EdgeServeError) -> JSONResponse:
    return worker_error_response("", exc)


def _admits(scope: Scope) -> bool:
    return scope["method"] == "POST" and scope["path"] in ADMITTING


def create_worker_app(engine: AsyncEngine, model_name: str, role: str = "unified",
                      coordinator: DecodeCoordinator | None = None, background: Sequence[Background] = (),
                      *, registration: Background | None = None, token: str | None = None,
                      header_limits: HeaderLimits = HeaderLimits(),
                      group_stats: Callable[[], dict[str, object]] | None = None) -> Starlette:
    """The worker's ASGI app, serving `engine` under the name `model_name` in `role`.

    `background` coroutines (the KV-event publisher) run for the app's lifetime;
    `registration` (the registry heartbeat) too, but it is cancelled, withdrawing the
    record, as soon as the engine dies or a drain starts. With `token`, every route but
    /health requires it. `app.state.drain` is the app's `Drain` (`ops/graceful.py` runs it).
    `group_stats`: a tensor-parallel worker's group figures (ranks, follower pids, collectives),
    under /stats "tensor_parallel"."""
    if (role == "decode") != (coordinator is not None):
        raise ValueError("a decode worker needs a DecodeCoordinator, and only a decode worker takes one")
    prefill_stats = TransferStats()
    cancel_keys: dict[str, str] = {}  # request id -> the key its caller set; only while its stream runs
    tasks: dict[str, asyncio.Task[None]] = {}

    async def leave_registry() -> None:
        task = tasks.pop("registration", None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    drain = Drain(on_start=leave_registry, end_rest=lambda err: _fail_all(engine, err))

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
        rid = req.request_id
        if rid is not None and rid in cancel_keys:
            return _error_response(InvalidRequest(f"request id {rid!r} is already in flight", request_id=rid))
        try:  # typed refusals surface here, before any byte is sent; then headers go out at once
            if coordinator is not None:
                await coordinator.check_prefill_url(req.prefill_url)
            stream = (coordinator.submit(req) if coordinator is not None else
                      engine.submit(req.prompt_ids, req.params, rid, cache_salt=req.cache_salt))
        except EdgeServeError as exc:
            return _error_response(exc)
        if rid is not None and req.cancel_key:
            cancel_keys[rid] = req.cancel_key

        async def close() -> None:  # also when the body never started (closing_response.py)
            await stream.aclose()  # aborts the request if it is not done
            if rid is not None and cancel_keys.get(rid) == req.cancel_key:
                cancel_keys.pop(rid, None)

        return ClosingStreamingResponse(ndjson_frames(stream, req.stream), on_close=close, media_type=NDJSON)

    async def cancel(request: Request) -> Response:
        rid = request.path_params["request_id"]
        try:
            presented = _cancel_decoder.decode(await request.body()).cancel_key
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            return _error_response(InvalidRequest(f"a cancel needs the request's cancel_key: {exc}"))
        expected = cancel_keys.get(rid)
        if expected is None or not hmac.compare_digest(expected.encode(), presented.encode()):
            # the same answer whether the id is unknown or the key wrong: ids are not revealed
            return _error_response(InvalidRequest(f"no request {rid!r} in flight that this key may cancel"))
        await engine.abort(rid)
        return JSONResponse({"cancelled": rid})

    async def health(request: Request) -> Response:
        status = "failed" if not _engine_alive(engine) else "draining" if drain.draining else "ok"
        return JSONResponse({"status": status, "role": role, "model": model_name},
                            status_code=200 if status == "ok" else 503)

    async def stats(request: Request) -> Response:
        transfer = coordinator.stats if coordinator is not None else prefill_stats
        extra = {"tensor_parallel": group_stats()} if group_stats is not None else {}
        if engine.store_tier is not None:
            extra["kv_store"] = engine.store_tier.snapshot()
        return JSONResponse({"role": role, "model": model_name, **engine.engine.snapshot(),
                             "kv_transfer": transfer.snapshot(), **extra})

    registry = worker_registry(engine.engine, model_name, role)

    async def metrics(request: Request) -> Response:
        return Response(render_metrics(registry), media_type=CONTENT_TYPE)

    async def watch_engine() -> None:
        """When the engine thread dies: leave the registry at once and end every waiting request."""
        while _engine_alive(engine):
            await asyncio.sleep(ENGINE_WATCH_S)
        log.error("engine thread of %s (%s) died: withdrawing from the registry", model_name, role,
                  exc_info=engine.failure)
        await leave_registry()
        _fail_all(engine, EngineStopped(f"the engine of this {role} worker stopped; retry on another"))

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
        others = [asyncio.create_task(run()) for run in background]
        if registration is not None:
            tasks["registration"] = asyncio.create_task(registration())
        watcher = asyncio.create_task(watch_engine())
        try:
            yield
        finally:
            await leave_registry()
            for task in (*others, watcher):
                task.cancel()
            await asyncio.gather(*others, watcher, return_exceptions=True)
            if coordinator is not None:
                await coordinator.aclose()
            engine.shutdown()

    middleware = [Middleware(HeaderLimitMiddleware, limits=header_limits, render=worker_error_response)]
    if token:
        middleware.append(Middleware(WorkerAuth, token=token))
    middleware.append(Middleware(DrainGate, drain=drain, admits=_admits, render=worker_error_response))
    app = Starlette(routes=routes, lifespan=lifespan, middleware=middleware)
    app.state.drain = drain
    return app


def _engine_alive(engine: AsyncEngine) -> bool:
    return engine.alive


def _fail_all(engine: AsyncEngine, err: Draining | EngineStopped) -> int:
    """End every request of `engine` with `err`; returns how many."""
    return engine.fail_all(err)
