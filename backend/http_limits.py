"""Request-header limits at the HTTP server (gateway and workers): a size and a count, answered 431.

uvicorn's httptools parser has no limit of its own. Measured on loopback: a 1 MB
header was accepted in 10 ms, a 32 MB one in 1.4 s with ~90 MB more memory. h11's
`h11_max_incomplete_event_size` would bound it, but answers a plain-text 400 and
gives up httptools' speed on the hot path. So two layers:

- `HeaderLimitMiddleware` (ASGI, in every app): more than `max_count` headers, or
  names and values totalling more than `max_bytes`, get 431 in the API's own error
  form (`render`) before any route runs. Also works under `httpx.ASGITransport`.
- `guarded_http_protocol(...)`, the httptools protocol `ops/graceful.py` serves
  with: it counts a request head's raw bytes as they arrive and answers 431
  (closing the connection) past `raw_cap_bytes`, so a huge head is never buffered
  whole. The cap sits far above `max_bytes` (a head within the limits plus one
  socket read of body), so every request the middleware could judge reaches it.
  It also sends a loop turn's writes together (`backend/coalesced_writes.py`): a
  response's head and body leave in one segment.

Limits: 100 headers and 32 KiB, in line with common servers (nginx's default
large header buffers are 4 x 8 KiB; Apache's LimitRequestFields is 100).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import NamedTuple

from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from backend.coalesced_writes import CoalescingTransport
from backend.errors import EdgeServeError, InvalidRequest

__all__ = ["HeaderLimits", "ErrorRender", "HeaderLimitMiddleware", "guarded_http_protocol", "too_large"]

ErrorRender = Callable[[str, EdgeServeError, int], Response]  # (path, error, HTTP status) -> the API's response
HEADERS_TOO_LARGE = 431


class HeaderLimits(NamedTuple):
    max_bytes: int = 32 * 2**10  # names plus values of all headers
    max_count: int = 100
    raw_cap_bytes: int = 2**20  # request line + headers as received, before parsing finishes


def too_large(limits: HeaderLimits, count: int | None = None, size: int | None = None) -> InvalidRequest:
    """The typed refusal (code 3000) that goes out with status 431."""
    seen = f": {count} headers, {size} bytes" if count is not None else ""
    return InvalidRequest(f"request headers too large{seen} (limits: {limits.max_count} headers, "
                          f"{limits.max_bytes} bytes)", max_headers=limits.max_count,
                          max_header_bytes=limits.max_bytes)


class HeaderLimitMiddleware:
    """ASGI middleware: 431 for requests over `limits`, rendered by `render`."""

    def __init__(self, app: ASGIApp, limits: HeaderLimits, render: ErrorRender) -> None:
        self.app, self.limits, self.render = app, limits, render

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = scope["headers"]
            size = sum(len(name) + len(value) for name, value in headers)
            if len(headers) > self.limits.max_count or size > self.limits.max_bytes:
                err = too_large(self.limits, len(headers), size)
                await self.render(scope["path"], err, HEADERS_TOO_LARGE)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def guarded_http_protocol(limits: HeaderLimits, render: ErrorRender) -> type:
    """uvicorn's httptools protocol with a hard cap on a request head's raw bytes (pass as `http=`)."""
    from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        _in_head = True
        _head_bytes = 0

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(CoalescingTransport(transport, self.loop))

        def data_received(self, data: bytes) -> None:
            if self.transport.is_closing():
                return
            if self._in_head:
                self._head_bytes += len(data)
                if self._head_bytes > limits.raw_cap_bytes:
                    self._refuse()
                    return
            super().data_received(data)

        def on_headers_complete(self) -> None:
            self._in_head = False
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._in_head, self._head_bytes = True, 0

        def _refuse(self) -> None:
            path = self.url.split(b"?", 1)[0].decode("latin-1") or "/"
            resp = render(path, too_large(limits), HEADERS_TOO_LARGE)
            head = [STATUS_LINE[HEADERS_TOO_LARGE]]
            for name, value in resp.raw_headers:
                head += [name, b": ", value, b"\r\n"]
            self.transport.write(b"".join([*head, b"connection: close\r\n\r\n", resp.body]))
            self.transport.close()

    return GuardedHttpToolsProtocol
