"""A client that leaves while its non-streaming answer is computed: cancel, as streaming does.

A streaming response notices a disconnect by itself: the next write fails, Starlette
closes the body iterator and `sse_stream` closes the generation. A non-streaming
handler writes nothing until the end, so without a watch it would run the request to
`max_tokens` and meter all of it. `collect_or_cancel` waits for the generation's
result and for the ASGI `http.disconnect` message together (the body has been read,
so the next message the server hands us is the disconnect); whichever comes first
wins. On a disconnect the generation is closed (`Generation.aclose`: the worker
aborts the request, frees its pages, and what was generated so far is metered) and
`RequestCancelled` (3041, 499) is raised.
"""

from __future__ import annotations

import asyncio
import logging

from starlette.requests import Request

from backend.errors import RequestCancelled
from gateway.generation import Done, Generation

__all__ = ["wait_for_disconnect", "collect_or_cancel"]

log = logging.getLogger(__name__)


async def wait_for_disconnect(request: Request) -> None:
    """Return once the client has disconnected (call only after the body has been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def collect_or_cancel(gen: Generation, request: Request) -> tuple[str, Done]:
    """`gen.collect()`, or, if the client disconnects first, close `gen` and raise `RequestCancelled`.
    One task (the disconnect watch); the generation's end is waited for in this one."""
    gone = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({gen.final, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if gen.final.done():
        return await gen.collect()  # the answer was ready (all queued): send it even if the client is leaving
    log.info("request %s: client disconnected before the answer; cancelling", gen.request_id)
    await gen.aclose()
    raise RequestCancelled("client disconnected before the answer was ready")
