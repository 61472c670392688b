"""The framework floor `edgeserve bench gateway` measures beside the gateway: a pass-through proxy on the gateway's
own stack (Starlette under uvicorn, with uvloop and httptools where installed, and one aiohttp session to the
upstream), with nothing of the gateway's work: no authentication, quotas, tokenisation, routing, detokenisation or
metering. It forwards ``POST /v1/chat/completions`` to the stand-in's same endpoint as it came and relays the
answer as it comes (an event stream chunk by chunk, anything else whole).

Its latency added over ``direct`` is what any Python ASGI proxy on these libraries pays on this machine (its CPU
per request, one more loopback hop); the gateway's added latency minus it is the gateway's own work. On a 2-core VM
whose speed drifts between spells, that difference is steadier than the gateway's figure alone.

    python -m ops.bench.gateway.passthrough --port P --upstream http://127.0.0.1:Q
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from starlette.applications import Starlette

__all__ = ["passthrough_app", "main"]


def passthrough_app(upstream: str) -> Starlette:
    """A Starlette app relaying ``POST /v1/chat/completions`` to `upstream` (module docstring); ``GET /healthz``
    answers 200 once it serves."""
    import aiohttp
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    url = upstream.rstrip("/") + "/v1/chat/completions"
    session: list[aiohttp.ClientSession] = []  # made inside the serving loop, on the first request

    async def chat(request: Request) -> Response:
        if not session:
            session.append(aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=300)))
        resp = await session[0].post(url, data=await request.body(),
                                     headers={"content-type": request.headers.get("content-type", "")})
        media_type = resp.headers.get("content-type", "application/json")
        if not media_type.startswith("text/event-stream"):
            try:
                return Response(await resp.read(), status_code=resp.status, media_type=media_type)
            finally:
                resp.release()

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in resp.content.iter_any():
                    yield chunk
            finally:
                resp.release()

        return StreamingResponse(relay(), status_code=resp.status, media_type=media_type)

    async def healthz(_: Request) -> Response:
        return Response("ok")

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        yield
        if session:
            await session.pop().close()

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]), Route("/healthz", healthz)],
                     lifespan=lifespan)


def main(argv: list[str] | None = None) -> int:
    """`python -m ops.bench.gateway.passthrough --port P --upstream URL`: serve the pass-through (the bench
    starts it)."""
    import uvicorn

    p = argparse.ArgumentParser(prog="python -m ops.bench.gateway.passthrough", description=passthrough_app.__doc__)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", required=True, help="the stand-in's base URL")
    args = p.parse_args(argv)
    uvicorn.run(passthrough_app(args.upstream), host="127.0.0.1", port=args.port, log_level="warning",
                access_log=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
