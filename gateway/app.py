"""The gateway ASGI app: routes, shared state, lifespan.

    POST /client/v4/accounts/{account_id}/ai/run/{model}            Workers AI text generation
    GET  /client/v4/accounts/{account_id}/ai/usage?from=&to=        the caller's own usage
    POST /client/v4/accounts/{account_id}/ai/v1/chat/completions    OpenAI chat, account-scoped
    POST /v1/chat/completions                                       OpenAI chat
    POST /client/v4/accounts/{account_id}/ai/v1/completions         OpenAI completions, account-scoped
    POST /v1/completions                                            OpenAI completions (prompt, echo, logprobs)
    GET  /v1/models                                                 served models and aliases
    GET  /v1/models/{model}                                         one of them (404 model_not_found)
    GET  /healthz                                                   gateway and Redis reachable
    GET  /livez                                                     the process answers (never touches Redis)
    GET  /readyz                                                    takes new requests: 503 while draining (no Redis)
    GET  /metrics                                                   Prometheus

Gateways hold no state of their own: tenants, keys, usage, quotas, the worker
registry and the prefix index are in Redis, so any number of them can share one
Redis. Models configured with worker URLs are served from that static list;
otherwise the router reads the live registry (workers heartbeat into Redis).

Errors take each API's form (`render_error`): an OpenAI error object under `/v1/`
(and the account-scoped chat completions and completions), else the Workers envelope; that holds for
unknown routes (404) and wrong methods (405, with `Allow`) too. Requests with too
many or too large headers get 431 (`backend/http_limits.py`), a POST whose body is not
sent as JSON 415 (`content_type.py`). A
draining gateway (`app.state.drain`, run on SIGTERM by `ops/graceful.py`) answers
new requests 503 `Draining`, lets open streams finish up to the drain timeout, then
ends each with an in-stream `Draining` error.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Scope

from backend.drain import Drain, DrainGate
from backend.errors import EdgeServeError, InvalidRequest
from backend.http_limits import HeaderLimitMiddleware, HeaderLimits
from backend.redis_client import connect as connect_redis
from backend.redis_lane import lane_for
from gateway.config import GatewayConfig
from prefix_cache.kv_events import PrefixIndex
from gateway.completions_api import completions
from gateway.content_type import JsonContentTypeMiddleware
from gateway.envelopes import error_headers, openai_error, openai_status, workers_error
from gateway.metering import Meter
from gateway.metrics import CONTENT_TYPE_LATEST, GatewayMetrics
from gateway.openai_api import chat_completions, get_model, list_models
from gateway.quotas import Quotas
from gateway.registry_view import RegistryView, StaticView
from gateway.router import Router
from gateway.served_models import ModelCatalog
from gateway.state import GatewayState
from gateway.tenants import TenantStore
from gateway.worker_pool import WorkerPool
from gateway.workers_api import workers_run, workers_usage

__all__ = ["create_gateway_app", "render_error"]

ACCOUNT = "/client/v4/accounts/{account_id}/ai"


def create_gateway_app(config: GatewayConfig) -> Starlette:
    """The gateway for `config`; tokenizers load now, connections open lazily."""
    catalog = ModelCatalog(config.models)
    redis = connect_redis(config.redis_url, max_connections=512)  # 1 s connect/reply timeouts: a 503 fast
    static = {m.name: list(m.route.workers) for m in catalog.models if m.route.workers}
    view = StaticView(static, config.region) if static else RegistryView(redis)
    router = Router(view, PrefixIndex(redis), config.regions, policy=config.routing_policy,
                    max_waiting=config.max_waiting_per_worker, load_slack=config.routing_load_slack,
                    load_slack_share=config.routing_load_slack_share,
                    recompute_weight=config.routing_recompute_weight)
    state = GatewayState(config=config, catalog=catalog, router=router,
                         pool=WorkerPool(config.worker_timeout_s, config.worker_token),
                         tenants=TenantStore(redis, tenant_cache_s=config.tenant_cache_s, tracked=True),
                         quotas=Quotas(redis),
                         meter=Meter(redis, config.usage_journal_path, flush_after_s=config.usage_flush_s),
                         metrics=GatewayMetrics())
    state.metrics.watch_auth(state.tenants)
    state.metrics.watch_piece_caches({m.name: m.tokenizer.piece_cache for m in catalog.models
                                      if m.tokenizer.piece_cache is not None})  # built now, not on a request

    async def healthz(request: Request) -> Response:
        try:
            await redis.ping()
        except Exception as exc:  # noqa: BLE001 - health reports, never raises
            return JSONResponse({"status": "degraded", "redis": f"unreachable: {type(exc).__name__}"}, 503,
                                headers={"Retry-After": "1"})
        return JSONResponse({"status": "ok", "region": config.region, "models": [m.name for m in catalog.models]})

    async def livez(request: Request) -> Response:
        """Liveness for orchestrators: the event loop answers. Never Redis: an outage must not
        restart every gateway (requests then get typed 503s, and /healthz says why)."""
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        """Readiness: 503 with Retry-After once draining (a SIGTERM), so a load balancer stops
        sending new requests while open streams finish; never Redis, like /livez."""
        if drain.draining:
            return JSONResponse({"status": "draining"}, 503, headers={"Retry-After": "1"})
        return JSONResponse({"status": "ok"})

    async def metrics(request: Request) -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def no_route(request: Request, exc: Exception) -> Response:
        """404 for a path no route serves, 405 (with `Allow`) for a method its route does not take."""
        status = exc.status_code if isinstance(exc, HTTPException) else 404
        allowed = exc.headers.get("Allow", "") if isinstance(exc, HTTPException) and exc.headers else ""
        allow = ", ".join(sorted(m.strip() for m in allowed.split(",") if m.strip()))  # Starlette's is a set
        if status == 405:
            err = InvalidRequest(f"{request.url.path} does not take {request.method}; it takes {allow}")
        else:
            err = InvalidRequest(f"no such URL: {request.method} {request.url.path}")
        response = render_error(request.url.path, err, status)
        if allow:
            response.headers["Allow"] = allow
        return response

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await state.meter.start()  # replays usage journaled while Redis was away
        try:
            yield
        finally:
            await state.meter.aclose()
            await state.pool.aclose()
            await state.tenants.aclose()
            if (lane := lane_for(redis)) is not None:
                await lane.aclose()
            await redis.aclose()

    routes = [
        Route(f"{ACCOUNT}/run/{{model:path}}", workers_run, methods=["POST"]),
        Route(f"{ACCOUNT}/usage", workers_usage, methods=["GET"]),
        Route(f"{ACCOUNT}/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route(f"{ACCOUNT}/v1/completions", completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/livez", livez, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    drain = Drain(end_rest=state.pool.end_streams)
    limits = HeaderLimits(max_bytes=config.max_header_bytes, max_count=config.max_headers)
    middleware = [Middleware(HeaderLimitMiddleware, limits=limits, render=render_error),
                  Middleware(JsonContentTypeMiddleware, render=render_error),
                  Middleware(DrainGate, drain=drain, admits=_admits, render=render_error)]
    app = Starlette(routes=routes, lifespan=lifespan, middleware=middleware,
                    exception_handlers={404: no_route, 405: no_route})
    app.state.gateway = state
    app.state.drain = drain
    return app


def render_error(path: str, exc: EdgeServeError, status: int | None = None) -> Response:
    """`exc` in the form of the API at `path`: an OpenAI error object (and OpenAI's status) under /v1/
    paths (and the account-scoped chat completions), else the Workers envelope; `status` overrides
    the error's own; Retry-After where it applies."""
    if "/v1/" in path:
        status = status or openai_status(exc)
        return JSONResponse(openai_error(exc, status), status_code=status, headers=error_headers(exc))
    return JSONResponse(workers_error(exc), status_code=status or exc.http_status, headers=error_headers(exc))


def _admits(scope: Scope) -> bool:
    return scope["method"] == "POST"  # every POST starts a generation
