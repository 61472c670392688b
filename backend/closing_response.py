"""A streamed response that always runs its cleanup, also when its body never started.

Starlette's `StreamingResponse` iterates its body inside a task that a client's
disconnect cancels. When the disconnect is already queued as the response starts
(the client left while the request was being admitted), that task is cancelled
before its first step, and so is an ASGI server that raises on `send` to a gone
client: the body's generator never starts, so nothing in it (no `finally`, no
`aclosing`) ever runs, and a request it was meant to close would run to its end
for nobody, its pages held. `ClosingStreamingResponse` closes the body and awaits
`on_close` once the response is over, however it ended, shielded from the
cancellation that ended it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

__all__ = ["ClosingStreamingResponse"]


class ClosingStreamingResponse(StreamingResponse):
    """`StreamingResponse` of `content`; when the response is over (sent, client gone, cancelled), the
    body generator is closed and `on_close` awaited (it must be idempotent and quick: it runs shielded)."""

    def __init__(self, content: AsyncIterator[bytes], *, on_close: Callable[[], Awaitable[None]],
                 media_type: str) -> None:
        super().__init__(content, media_type=media_type)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
                await self._on_close()
