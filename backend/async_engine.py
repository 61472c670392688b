"""Runs `LLMEngine` on its own thread and streams events to asyncio callers.

The engine thread loops `step()` while there is work and sleeps on the
scheduler's wake-up event otherwise. Each step's events are handed to the event
loop in one `call_soon_threadsafe` call (not one per token). A caller that closes
its `EventStream` before the final event (client gone, cancel) aborts its request,
also when it never read from it; the pages return at the next step boundary. A
token for a request nobody subscribes to any more aborts it too.

Failures. A step whose batch fails (model, sampling, integrity check) ends the
requests in it, each with an `ErrorEvent`, and the thread goes on serving the
others. The thread stops when the loop cannot go on: an exception escapes
`LLMEngine.step()` (scheduling, activation, expiry: engine state may be half
updated) or anywhere else in the loop, or `MAX_FAILED_STEPS_IN_ROW` steps in a row
fail (a device that fails every step). Then it records `failure`, `alive` turns
False, every subscribed request (waiting, running, held, receiving) gets an
`ErrorEvent` of `EngineStopped` at once, the scheduler is closed (pages returned
where possible) and `submit` / `attach` raise `EngineStopped` from then on. The
worker's `/health` reads `alive`.

`fail_all(err)` ends every subscribed request with `err` now (drain timeout);
`num_active()` counts them.

Tensor parallelism: when a rank of the engine's group dies (`Collectives.on_failure`:
the group's watchdog, or a collective that raised), every subscribed request ends at
once with `GroupFailure` and `alive` turns False, without waiting for the engine
thread: that thread may sit in a collective on the dead rank until the group's timeout
(a dead peer closes its connections, which usually ends the wait at once, but not
always). It stops itself when that step fails, and returns the pages then.

With a KV store tier (`kv_store_tier.py`), `submit` first asks the tier to fetch the
prompt's blocks that follow its locally cached prefix. Such a request is checked at
once (`Scheduler.check_room`: a refusal still raises in `submit`) but queued only when
its fetch has finished or its deadline (`fetch_timeout_s`) has passed, whichever comes
first: the engine thread then installs what arrived (`KVStoreTier.install`) and adds the
request in the same loop turn, before the step whose admission matches those blocks.
The engine thread sleeps at most until the nearest deadline while fetches are pending.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from backend.engine import LLMEngine, StepOutput
from backend.errors import EdgeServeError, EngineStopped, InvalidRequest
from backend.protocol import ErrorEvent, Event, FinishEvent, TokenEvent
from backend.sampling_params import SamplingParams
from backend.sequence import Sequence

if TYPE_CHECKING:
    from backend.kv_store_tier import KVStoreTier, StoreFetch

__all__ = ["AsyncEngine", "EventStream", "MAX_FAILED_STEPS_IN_ROW"]

log = logging.getLogger(__name__)

MAX_FAILED_STEPS_IN_ROW = 3  # that many failed batches in a row stop the engine (the device is gone)


@dataclass(eq=False)
class _Subscriber:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Event]
    tokens: int = 0  # token ids delivered so far (completion_tokens of an error that ends it from outside)


def _finish_event(seq: Sequence) -> FinishEvent:
    ttft = seq.first_token_time - seq.arrival_time if seq.first_token_time is not None else None
    return FinishEvent(finish_reason=seq.finish_reason or "stop", prompt_tokens=seq.num_prompt_tokens,
                       completion_tokens=len(seq.output_ids), cached_tokens=seq.num_cached_tokens,
                       stop_reason=seq.stop_reason, ttft_s=ttft,
                       total_s=time.perf_counter() - seq.arrival_time)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, store_tier: KVStoreTier | None = None, threads: int | None = None) -> None:
        """`store_tier`: a `KVStoreTier` attached to `engine`, fetched from before admission. `threads`: torch's
        thread count on the engine thread, set there when it starts (the thread then owns torch's OpenMP pool;
        `kernels.cpu_threads.yield_openmp_to_engine_thread`); None leaves it as it is."""
        self.engine = engine
        self._threads = threads
        self.store_tier = store_tier
        self._subs: dict[str, _Subscriber] = {}
        self._pending: list[StoreFetch] = []  # requests waiting for their store fetch (guarded by _lock)
        self._lock = threading.Lock()  # guards _subs, _pending and _failure
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="edgeserve-engine", daemon=True)
        self._started = False
        self._failure: BaseException | None = None
        group = getattr(engine, "group", None)
        if group is not None:
            group.on_failure(self._group_failed)

    @property
    def alive(self) -> bool:
        """False once the engine thread stopped on a failure (see `failure`) or was shut down."""
        if self._failure is not None:
            return False
        return not self._started or self._thread.is_alive()

    @property
    def failure(self) -> BaseException | None:
        """What stopped the engine thread, or None while it serves."""
        return self._failure

    def num_active(self) -> int:
        """Requests with a live subscription (submitted or attached, final event not yet delivered)."""
        with self._lock:
            return len(self._subs)

    def fail_all(self, err: EdgeServeError, stop: bool = False) -> int:
        """End every subscribed request now with `err` as its final `ErrorEvent`; return how many.

        Any thread (the worker's event loop at its drain timeout). Each request is aborted too, so
        its pages return at the next step boundary (a reservation still receiving KV: when its
        reader releases it, or at its first token). The engine goes on serving new requests, unless
        `stop`: then `err` is the failure (`alive` False, `submit` and `attach` refuse), set together
        with taking the requests, so none can slip in between."""
        with self._lock:
            subs, self._subs = self._subs, {}
            if stop and self._failure is None:
                self._failure = err
        self._end(subs, err)
        for rid in subs:
            self.engine.abort(rid)
        return len(subs)

    def _group_failed(self, err: EdgeServeError) -> None:
        """A rank of the engine's group is gone (any thread): end every request with the group's typed error now
        and stop taking work; the engine thread follows when its step fails (see the module docstring)."""
        ended = self.fail_all(err, stop=True)
        log.error("tensor-parallel group failed: %d requests ended, the engine stops", ended)
        self.engine.scheduler.wake()

    def start(self) -> None:
        if not self._started:
            self._started = True
            self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self.engine.scheduler.wake()
        if self._started:
            self._thread.join(timeout=10)
        if self.store_tier is not None:
            self.store_tier.close()

    # -- engine thread -----------------------------------------------------------------
    def _loop(self) -> None:
        if self._threads:
            torch.set_num_threads(self._threads)
        try:
            self.engine.model.pack_prompt_weights()  # before the first request, not during it
            while not self._stop.is_set():
                self.engine.scheduler.wait_for_work(timeout=self._wait_timeout())
                if self._stop.is_set():
                    break
                if self._pending:
                    self._admit_fetched()
                if not self.engine.has_work():  # idle: refresh what other threads changed (held pages freed)
                    self.engine.publish(force=True)
                    continue
                outputs = self.engine.step()
                if self.engine.failed_steps_in_row >= MAX_FAILED_STEPS_IN_ROW:
                    raise RuntimeError(f"{self.engine.failed_steps_in_row} engine steps in a row failed")
                self._deliver(self._events(outputs))
        except BaseException as exc:  # noqa: BLE001 - the thread ends here; everyone waiting must hear of it
            self._die(exc)

    def _die(self, exc: BaseException) -> None:
        """Record the failure, refuse new work, free what can be freed, end every subscribed request."""
        log.critical("the engine thread stopped; every request ends with EngineStopped", exc_info=exc)
        err = EngineStopped("this worker's engine stopped; the request can be retried on another worker")
        with self._lock:
            self._failure = exc  # from here on submit/attach refuse
            self._pending.clear()  # their subscribers are ended below; the fetched blocks are dropped
        try:
            self.engine.scheduler.close(err)
            self.engine.publish(force=True)
        except Exception:  # noqa: BLE001 - the subscribers must still be told
            log.exception("could not close the stopped engine's scheduler")
        with self._lock:
            subs, self._subs = self._subs, {}
        self._end(subs, err)

    def _end(self, subs: dict[str, _Subscriber], err: EdgeServeError) -> None:
        """Give each subscriber `err` as its final event (one call per event loop)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Event], Event]]] = {}
        for sub in subs.values():
            ev = ErrorEvent(err.code, type(err).__name__, err.message, sub.tokens)
            by_loop.setdefault(sub.loop, []).append((sub.queue, ev))
        _post(by_loop)

    def _wait_timeout(self) -> float:
        """How long the idle engine thread may sleep: until the nearest fetch deadline, at most 0.5 s."""
        with self._lock:
            if not self._pending:
                return 0.5
            nearest = min(f.deadline for f in self._pending)
        return min(0.5, max(0.0, nearest - time.monotonic()))

    def _admit_fetched(self) -> None:
        """Engine thread: install the blocks of fetches that finished or ran out of time, then queue their
        requests (a request whose stream was closed meanwhile is dropped; a refusal ends its stream)."""
        now = time.monotonic()
        with self._lock:
            ready = [f for f in self._pending if f.done.is_set() or now >= f.deadline]
            self._pending = [f for f in self._pending if f not in ready]
        for fetch in ready:
            seq = fetch.seq
            with self._lock:
                live = seq.request_id in self._subs
            if not live:
                fetch.take()
                continue
            self.store_tier.install(fetch)
            try:
                self.engine.scheduler.add(seq)
            except EdgeServeError as err:  # the queue filled meanwhile, or the scheduler closed
                with self._lock:
                    sub = self._subs.pop(seq.request_id, None)
                if sub is not None:
                    _post({sub.loop: [(sub.queue, ErrorEvent(err.code, type(err).__name__, err.message, 0))]})

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
                events.append((s.request_id, TokenEvent([out.new_token], [out.token_time - s.arrival_time],
                                                        out.logprobs, out.prompt_logprobs)))
            elif out.prompt_logprobs is not None:  # max_tokens 0: the prompt's scores, no token
                events.append((s.request_id, TokenEvent([], [], prompt_logprobs=out.prompt_logprobs)))
            if out.finished:
                events.append((s.request_id, _finish_event(s)))
        return events

    def _deliver(self, events: list[tuple[str, Event]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Event], Event]]] = {}
        orphans: list[str] = []
        with self._lock:
            for rid, ev in events:
                if isinstance(ev, TokenEvent):
                    sub = self._subs.get(rid)
                    if sub is None:  # nobody reads it any more (ended by fail_all, detached): stop it
                        orphans.append(rid)
                        continue
                    sub.tokens += len(ev.token_ids)
                else:
                    # A final event ends the subscription here too, so a stream that was never
                    # iterated (its reader vanished before the first byte) leaves nothing behind.
                    sub = self._subs.pop(rid, None)
                if sub is not None:
                    by_loop.setdefault(sub.loop, []).append((sub.queue, ev))
        _post(by_loop)
        for rid in orphans:
            self.engine.abort(rid)

    # -- callers -----------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None, *,
               cache_salt: str | None = None, hold: bool = False) -> EventStream:
        """Admit one request now and return its event stream.

        Refusals (bad params, prompt too long, queue full, EngineStopped) raise here,
        synchronously, so a server can answer them with an HTTP status and start streaming
        as soon as the request is queued. Must be called from the event loop that reads the stream.
        """
        self.start()
        queue: asyncio.Queue[Event] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        with self._lock:
            self._check_alive()
            if request_id is not None and request_id in self._subs:
                raise InvalidRequest(f"request id {request_id!r} is already in flight", request_id=request_id)
            seq = self.engine.new_sequence(prompt_ids, params, request_id, cache_salt, hold)
            fetch = None
            if self.store_tier is not None:
                self.engine.scheduler.check_room(seq, len(self._pending))
                fetch = self.store_tier.prefetch(seq, self.engine.scheduler.wake)
            if fetch is None:
                self.engine.scheduler.add(seq)
            else:
                self._pending.append(fetch)
            self._subs[seq.request_id] = _Subscriber(loop, queue)
        return EventStream(self, seq.request_id, queue)

    def attach(self, seq: Sequence) -> EventStream:
        """Stream the events of a sequence that enters the engine later (decode role: `activate`).
        Call before activating it; closing the stream early aborts it. Raises EngineStopped once the
        engine thread has stopped."""
        self.start()
        queue: asyncio.Queue[Event] = asyncio.Queue()
        with self._lock:
            self._check_alive()
            if seq.request_id in self._subs:
                raise InvalidRequest(f"request id {seq.request_id!r} is already in flight", request_id=seq.request_id)
            self._subs[seq.request_id] = _Subscriber(asyncio.get_running_loop(), queue)
        return EventStream(self, seq.request_id, queue)

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[Event]:
        """Stream events for one request (`submit` and iterate). Refusals raise before the first event."""
        async with contextlib.aclosing(self.submit(prompt_ids, params, request_id)) as events:
            async for ev in events:
                yield ev

    def _check_alive(self) -> None:
        """Raise EngineStopped if the engine thread has stopped (call with the lock held)."""
        if self._failure is not None:
            raise EngineStopped("this worker's engine stopped; the request can be retried on another worker")

    def _release(self, request_id: str, queue: asyncio.Queue[Event]) -> bool:
        """Drop this stream's subscription; True if it was still there (nobody else ended it)."""
        with self._lock:
            sub = self._subs.get(request_id)
            if sub is None or sub.queue is not queue:  # ended already, or a later request reused the id
                return False
            del self._subs[request_id]
            return True

    def detach(self, request_id: str) -> None:
        """Drop a subscription whose stream was never read (idempotent)."""
        with self._lock:
            self._subs.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)


class EventStream:
    """One request's events, from `AsyncEngine.submit` or `attach`: tokens, then one final event.

    `aclose` ends it at any time, also before the first read (a generator that never started
    would have nothing to run): the subscription goes, and a request whose final event has not
    arrived is aborted, so its pages return at the next step boundary. A reader cancelled while
    it waits for an event closes it too. A request someone else ended first (its final event
    queued, `fail_all`, `detach`) is left as it is. Close it (`contextlib.aclosing`) wherever its
    reader may stop early or never start.
    """

    def __init__(self, engine: AsyncEngine, request_id: str, queue: asyncio.Queue[Event]) -> None:
        self.request_id = request_id
        self._engine, self._queue = engine, queue
        self._done = False  # the final event was read, or the stream was closed

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> Event:
        if self._done:
            raise StopAsyncIteration
        try:
            ev = await self._queue.get()
        except asyncio.CancelledError:  # its reader was cancelled (client gone): as a generator's finally would
            await self.aclose()
            raise
        if not isinstance(ev, TokenEvent):
            self._done = True  # the engine dropped the subscription when it queued this
        return ev

    async def aclose(self) -> None:
        """End the stream; abort the request unless it has ended (idempotent)."""
        if self._done:
            return
        self._done = True
        if self._engine._release(self.request_id, self._queue):
            self._engine.engine.abort(self.request_id)


def _post(by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Event], Event]]]) -> None:
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the caller's loop is closed; its requests were aborted
            pass


def _put_all(items: list[tuple[asyncio.Queue[Event], Event]]) -> None:
    for queue, ev in items:
        queue.put_nowait(ev)
