"""Graceful drain of one server, a worker or a gateway (started by SIGTERM, `ops/graceful.py`).

    await drain.run(timeout_s)
      1. stop admitting   `draining` is set: `DrainGate` answers new work with 503
                          `Draining` (Retry-After); `on_start` runs (a worker leaves the
                          registry first, so routers stop sending it anything)
      2. finish           requests in flight run on, up to `timeout_s`
      3. end the rest     `end_rest(Draining(...))` ends whatever still runs with that
                          typed error (a worker: every engine request; a gateway: every
                          open worker stream, so each client gets an in-stream error and
                          is metered for what it received), then waits up to `grace_s`
                          for those responses to go out

A second signal skips the wait of step 2 (`hurry`). Requests count as in flight
from the gate until their response (streamed or not) is complete.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import NamedTuple

from starlette.types import ASGIApp, Receive, Scope, Send

from backend.errors import Draining
from backend.http_limits import ErrorRender

__all__ = ["Drain", "DrainResult", "DrainGate"]

log = logging.getLogger(__name__)


class DrainResult(NamedTuple):
    in_flight_at_start: int
    ended_by_timeout: int  # requests `end_rest` ended with Draining (0 when everything finished in time)
    seconds: float


class Drain:
    """The drain state of one server, shared by its gate (`DrainGate`) and its runner."""

    def __init__(self, *, on_start: Callable[[], Awaitable[None]] | None = None,
                 end_rest: Callable[[Draining], int] | None = None, retry_after_s: float = 1.0) -> None:
        self.draining = False
        self.in_flight = 0
        self._on_start, self._end_rest, self.retry_after_s = on_start, end_rest, retry_after_s
        self._hurry = False

    def error(self, what: str = "this server") -> Draining:
        """The typed refusal for work that arrives, or is still running, during a drain."""
        return Draining(f"{what} is shutting down; retry on another", retry_after_s=self.retry_after_s)

    def hurry(self) -> None:
        """Stop waiting for in-flight requests (a second signal): end them now."""
        self._hurry = True

    async def run(self, timeout_s: float, grace_s: float = 5.0) -> DrainResult:
        """Stop admitting, let in-flight requests finish up to `timeout_s`, end the rest (see module doc)."""
        started, at_start = time.monotonic(), self.in_flight
        self.draining = True
        if self._on_start is not None:
            try:
                await self._on_start()
            except Exception:  # leaving the registry failed: its record still expires by itself
                log.warning("drain: on_start failed", exc_info=True)
        ended = 0
        if not await self._wait_idle(started + timeout_s, hurry=True):
            ended = self._end_rest(self.error()) if self._end_rest is not None else 0
            log.warning("drain: %d request(s) still running after %.0f s; ended with Draining", ended, timeout_s)
            await self._wait_idle(time.monotonic() + grace_s, hurry=False)
        return DrainResult(at_start, ended, time.monotonic() - started)

    async def _wait_idle(self, deadline: float, hurry: bool) -> bool:
        while self.in_flight > 0:
            if time.monotonic() >= deadline or (hurry and self._hurry):
                return False
            await asyncio.sleep(0.05)
        return True


class DrainGate:
    """ASGI middleware: counts admitted work in flight and refuses new work while draining.

    `admits(scope)` says which requests are new work (generate, prefill, a chat
    completion); others (health, stats, cancel) always pass and are not counted."""

    def __init__(self, app: ASGIApp, drain: Drain, admits: Callable[[Scope], bool], render: ErrorRender) -> None:
        self.app, self.drain, self.admits, self.render = app, drain, admits, render

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.admits(scope):
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            err = self.drain.error()
            await self.render(scope["path"], err, err.http_status)(scope, receive, send)
            return
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1
