"""Serve an app (worker or gateway) with uvicorn, draining gracefully on SIGTERM or Ctrl-C.

uvicorn on its own stops listening at the first SIGTERM and then re-raises the
signal, so the process dies by it (exit 143) and nobody tells the routers. Here the
first SIGTERM/SIGINT runs the app's `Drain` (`app.state.drain`, `backend/drain.py`):
the server keeps listening and answers new work 503 Draining, in-flight requests
finish up to `drain_timeout_s`, the rest end with the typed error; then uvicorn
shuts down and `serve` returns (exit 0). A second signal ends the wait at once.
Headers are bounded at the parser (`backend/http_limits.py`). Before listening, everything built so far (the
app, a worker's engine and model) is frozen out of the garbage collector's sight (`backend/heap.py`), so a full
collection while serving walks only what serving made.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from types import FrameType

import uvicorn
from starlette.applications import Starlette

from backend.drain import Drain
from backend.heap import freeze_heap
from backend.http_limits import ErrorRender, HeaderLimits, guarded_http_protocol

__all__ = ["serve", "DrainingServer"]

log = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose exit signals drain the app first (and are not re-raised afterwards)."""

    def __init__(self, config: uvicorn.Config, drain: Drain, drain_timeout_s: float,
                 on_ready: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        self.drain, self.drain_timeout_s, self.on_ready = drain, drain_timeout_s, on_ready
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining: asyncio.Task[None] | None = None

    async def serve(self, sockets=None) -> None:  # noqa: ANN001 - uvicorn's signature
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets=None) -> None:  # noqa: ANN001 - uvicorn's signature
        await super().startup(sockets)
        if self.started and self.on_ready is not None:  # listening: requests are answered from now on
            self.on_ready()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._loop is None:
            self.should_exit = True
        elif self._draining is None:
            self._loop.call_soon_threadsafe(self._start_drain)
        else:
            self.drain.hurry()

    def _start_drain(self) -> None:
        if self._draining is None:
            self._draining = asyncio.create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            result = await self.drain.run(self.drain_timeout_s)
            log.info("drained: %d in flight at the signal, %d ended by the timeout, %.1f s", *result)
        finally:
            self.should_exit = True


def serve(app: Starlette, host: str, port: int, *, drain_timeout_s: float, render: ErrorRender,
          limits: HeaderLimits = HeaderLimits(), on_ready: Callable[[], None] | None = None) -> None:
    """Run `app` (with a `Drain` at `app.state.drain`) until a signal and its drain have ended, the heap built
    so far frozen (`freeze_heap`); `on_ready` runs once it listens."""
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                            http=guarded_http_protocol(limits, render), timeout_graceful_shutdown=5)
    server = DrainingServer(config, app.state.drain, drain_timeout_s, on_ready)
    freeze_heap()  # the app and what it serves with are built: long-lived from here on
    server.run()

