"""Server-sent events: framing, keep-alive comments, and the shared stream loop of both APIs.

    data: {...}\n\n        one event (JSON on one line)
    : keep-alive\n\n       a comment, sent while a request waits so proxies keep the connection
    data: [DONE]\n\n       end of a successful stream

After the stream has started an error cannot change the HTTP status, so it goes
out as one last event (rendered by the API) and the stream ends without [DONE].
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import msgspec

from backend.errors import EdgeServeError
from gateway.generation import Delta, Done, Generation

__all__ = ["sse_event", "sse_stream", "DONE", "KEEPALIVE", "SSE_HEADERS"]

DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keep-alive\n\n"
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
_encode = msgspec.json.Encoder().encode


def sse_event(data: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + _encode(data) + b"\n\n"


async def sse_stream(
    gen: Generation,
    keepalive_s: float,
    on_delta: Callable[[Delta], bytes],
    on_done: Callable[[Done], Iterable[bytes]],
    on_error: Callable[[EdgeServeError], bytes],
) -> AsyncIterator[bytes]:
    """Bytes of one SSE response; closing it (client gone) cancels the generation."""
    try:
        while True:
            item = await gen.next_item(keepalive_s)
            if item is None:
                yield KEEPALIVE
            elif isinstance(item, Delta):
                yield on_delta(item)
            elif isinstance(item, Done):
                for chunk in on_done(item):
                    yield chunk
                yield DONE
                return
            else:
                yield on_error(item)
                return
    finally:
        await gen.aclose()
