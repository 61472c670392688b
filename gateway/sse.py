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

`SSEResponse` sends such a stream without Starlette's `StreamingResponse` machinery (an
anyio task group and two tasks per response, ~50 us of CPU here against ~6): one task
watches for the client's `http.disconnect` and cancels the response's own task, which
closes the stream (and with it the generation), as Starlette's does.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import msgspec
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from backend.errors import EdgeServeError
from gateway.generation import Delta, Done, Generation

__all__ = ["sse_event", "sse_stream", "sse_response", "SSEResponse", "DONE", "KEEPALIVE", "SSE_HEADERS"]

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


class SSEResponse(Response):
    """A `text/event-stream` response of `body`'s chunks; `after` runs once the response is over
    (sent, the client gone, or failed), as a `StreamingResponse`'s background task does."""

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[bytes], headers: dict[str, str],
                 after: Callable[[], Awaitable[None]] | None = None) -> None:
        self.body_iterator, self.after = body, after
        self.status_code, self.background = 200, None
        self.init_headers({**SSE_HEADERS, **headers})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        gone = False

        async def watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            task.cancel()  # the client left: stop waiting for the body

        watcher = asyncio.ensure_future(watch())
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not gone:
                raise
            task.uncancel()
        finally:  # also when `send` raised (a server that reports a gone client) or the body never started
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.body_iterator.aclose()  # closing an unfinished stream cancels its generation
            if self.after is not None:
                await self.after()


def sse_response(gen: Generation, keepalive_s: float, headers: dict[str, str], *,
                 on_delta: Callable[[Delta], bytes], on_done: Callable[[Done], Iterable[bytes]],
                 on_error: Callable[[EdgeServeError], bytes]) -> SSEResponse:
    """The streamed response of `gen` (`sse_stream`); once it is over, it waits for the metering."""
    return SSEResponse(sse_stream(gen, keepalive_s, on_delta, on_done, on_error), headers, after=gen.aclose)
