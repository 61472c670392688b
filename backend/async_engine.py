"""Runs `LLMEngine` on its own thread and streams events to asyncio callers.

The engine thread loops `step()` while there is work and sleeps on the
scheduler's wake-up event otherwise. Each step's events are handed to the event
loop in one `call_soon_threadsafe` call (not one per token). A caller that stops
iterating (client gone, cancel) aborts its request; the pages return at the next
step boundary. If a step fails, the engine ends the requests in it (pages
returned) and each gets an `ErrorEvent`; the thread goes on serving the others.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from typing import NamedTuple

from backend.engine import LLMEngine, StepOutput
from backend.errors import InvalidRequest
from backend.protocol import ErrorEvent, Event, FinishEvent, TokenEvent
from backend.sampling_params import SamplingParams
from backend.sequence import Sequence

__all__ = ["AsyncEngine"]

log = logging.getLogger(__name__)


class _Subscriber(NamedTuple):
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Event]


def _finish_event(seq: Sequence) -> FinishEvent:
    ttft = seq.first_token_time - seq.arrival_time if seq.first_token_time is not None else None
    return FinishEvent(finish_reason=seq.finish_reason or "stop", prompt_tokens=seq.num_prompt_tokens,
                       completion_tokens=len(seq.output_ids), cached_tokens=seq.num_cached_tokens,
                       stop_reason=seq.stop_reason, ttft_s=ttft,
                       total_s=time.perf_counter() - seq.arrival_time)


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._subs: dict[str, _Subscriber] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="edgeserve-engine", daemon=True)
        self._started = False

    def start(self) -> None:
        if not self._started:
            self._started = True
            self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self.engine.scheduler._wakeup.set()
        if self._started:
            self._thread.join(timeout=10)

    # -- engine thread -----------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            self.engine.scheduler.wait_for_work(timeout=0.5)
            if self._stop.is_set():
                break
            if not self.engine.has_work():
                continue
            self._deliver(self._events(self.engine.step()))

    def _events(self, outputs: list[StepOutput]) -> list[tuple[str, Event]]:
        events: list[tuple[str, Event]] = []
        for out in outputs:
            s = out.seq
            if out.error is not None:
                err = out.error
                events.append((s.request_id, ErrorEvent(err.code, type(err).__name__, err.message,
                                                        len(s.output_ids))))
                continue
            if out.new_token is not None:
                events.append((s.request_id, TokenEvent([out.new_token], [out.token_time - s.arrival_time])))
            if out.finished:
                events.append((s.request_id, _finish_event(s)))
        return events

    def _deliver(self, events: list[tuple[str, Event]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Event], Event]]] = {}
        with self._lock:
            for rid, ev in events:
                # A final event ends the subscription here too, so a stream that was never
                # iterated (its reader vanished before the first byte) leaves nothing behind.
                sub = self._subs.pop(rid, None) if not isinstance(ev, TokenEvent) else self._subs.get(rid)
                if sub is not None:
                    by_loop.setdefault(sub.loop, []).append((sub.queue, ev))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the caller's loop is closed; its requests were aborted
                pass

    # -- callers -----------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None, *,
               cache_salt: str | None = None, hold: bool = False) -> AsyncIterator[Event]:
        """Admit one request now and return its event stream.

        Refusals (bad params, prompt too long, queue full) raise here, synchronously, so a
        server can answer them with an HTTP status and start streaming as soon as the
        request is queued. Must be called from the event loop that reads the stream.
        """
        self.start()
        queue: asyncio.Queue[Event] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        with self._lock:
            if request_id is not None and request_id in self._subs:
                raise InvalidRequest(f"request id {request_id!r} is already in flight", request_id=request_id)
            seq = self.engine.add_request(prompt_ids, params, request_id, cache_salt=cache_salt, hold=hold)
            self._subs[seq.request_id] = _Subscriber(loop, queue)
        return self._stream(seq.request_id, queue)

    def attach(self, seq: Sequence) -> AsyncIterator[Event]:
        """Stream the events of a sequence that enters the engine later (decode role: `activate`).
        Call before activating it; closing the stream early aborts it."""
        self.start()
        queue: asyncio.Queue[Event] = asyncio.Queue()
        with self._lock:
            if seq.request_id in self._subs:
                raise InvalidRequest(f"request id {seq.request_id!r} is already in flight", request_id=seq.request_id)
            self._subs[seq.request_id] = _Subscriber(asyncio.get_running_loop(), queue)
        return self._stream(seq.request_id, queue)

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[Event]:
        """Stream events for one request (`submit` and iterate). Refusals raise before the first event."""
        async for ev in self.submit(prompt_ids, params, request_id):
            yield ev

    async def _stream(self, request_id: str, queue: asyncio.Queue[Event]) -> AsyncIterator[Event]:
        done = False
        try:
            while True:
                ev = await queue.get()
                yield ev
                if not isinstance(ev, TokenEvent):
                    done = True
                    return
        finally:
            with self._lock:
                self._subs.pop(request_id, None)
            if not done:
                self.engine.abort(request_id)

    def detach(self, request_id: str) -> None:
        """Drop a subscription whose stream was never read (idempotent)."""
        with self._lock:
            self._subs.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)


def _put_all(items: list[tuple[asyncio.Queue[Event], Event]]) -> None:
    for queue, ev in items:
        queue.put_nowait(ev)
