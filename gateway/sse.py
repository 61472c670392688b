"""Server-sent events: framing, keep-alive comments, and the shared stream loop of both APIs.

    data: {...}\n\n        one event (JSON on one line)
    : keep-alive\n\n       a comment, sent while a request waits so proxies keep the connection
    data: [DONE]\n\n       end of a successful stream

After the stream has started an error cannot change the HTTP status, so it goes
out as one last event (rendered by the API) and the stream ends without [DONE].

Per token, the cost is the event's JSON and one write to the client. Events that
are ready together (tokens that arrived in one read from the worker, or while the
client's previous write was going out) leave in one write: the client sees the
same events, in the same order, with fewer sends. The stream's last bytes go out
before the generation's usage reaches Redis: `sse_response` leaves that wait to
the response's background task, so metering is off the client's latency (it is
still awaited, and it happens exactly once, also when the client leaves early).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import msgspec
from starlette.background import BackgroundTask
from starlette.responses import StreamingResponse

from backend.errors import EdgeServeError
from gateway.generation import Delta, Done, Generation

__all__ = ["sse_event", "sse_stream", "sse_response", "DONE", "KEEPALIVE", "SSE_HEADERS"]

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
    """Bytes of one SSE response, one chunk per batch of ready items; closing it before its end
    (client gone) cancels the generation. After the end, `gen.aclose()` is the caller's to await."""
    ended = False
    try:
        while True:
            items = await gen.next_items(keepalive_s)
            if not items:
                yield KEEPALIVE
                continue
            out: list[bytes] = []
            for item in items:
                if isinstance(item, Delta):
                    out.append(on_delta(item))
                    continue
                if isinstance(item, Done):
                    out.extend(on_done(item))
                    out.append(DONE)
                else:
                    out.append(on_error(item))
                ended = True
                yield b"".join(out)
                return
            yield b"".join(out)
    finally:
        if not ended:
            await gen.aclose()


def sse_response(gen: Generation, keepalive_s: float, headers: dict[str, str], *,
                 on_delta: Callable[[Delta], bytes], on_done: Callable[[Done], Iterable[bytes]],
                 on_error: Callable[[EdgeServeError], bytes]) -> StreamingResponse:
    """The streamed response of `gen` (`sse_stream`), whose background task waits for its metering."""
    return StreamingResponse(sse_stream(gen, keepalive_s, on_delta, on_done, on_error),
                             media_type="text/event-stream", headers={**SSE_HEADERS, **headers},
                             background=BackgroundTask(gen.aclose))
