"""One request's run behind either API: worker stream → text deltas, metered exactly once.

    gen = Generation(...);  await gen.start()      # quota, worker admission: typed refusals raise here
    async for item in gen.events(): ...            # Delta(text) ..., then one Done; errors raise
    text, done = await gen.collect()               # or all at once (`stream=False`: decoded once, at the end)
    gen.token_ids, gen.logprobs, gen.prompt_logprobs   # what arrived, when the request asked for logprobs
    await gen.aclose()                              # always (finally): cancels if unfinished, waits for metering

A producer task owns the worker stream from start to end, so its HTTP stream,
detokeniser and metering live in one task. The response side only reads a
queue: it can wait with a timeout (SSE keep-alives) and can be cancelled by a
client disconnect without tearing the worker stream apart mid-read. Cancelling
the producer closes the worker stream (the worker aborts the request and frees
its pages) and also sends an explicit cancel.

Metering starts in the producer's `finally` as a task of its own, shielded from
cancellation, and `aclose` waits for it; once the final item is queued, `aclose`
no longer cancels the producer (the response side closes right after reading
Done, while the metering is still on its way to Redis). Exactly once per request
id (the Redis script refuses a second record): completion tokens are the tokens
that reached the gateway, also when the
client left or the worker died mid-stream. A request refused before the worker
admitted it is not metered; its quota reservation is released.

Quota admission (a Redis round trip, for tenants with quotas) and routing (the prefix
index, another) run side by side in `start`, so a request waits for one round trip,
not two (a tenant without quotas is admitted without one). The quota's answer still decides first: a refused request is refused for
its quota (and leaves the router's in-flight count as it was), and a request the
router cannot place gives its reservation back. Routing therefore sizes the request
by the `max_tokens` asked for, before a tokens-per-day cap lowers it (so it may
judge a worker full that the capped request would fit; never the other way).

Items reach the response side through a queue; `next_items` hands over everything
queued at once, so tokens that arrived together leave in one write.

Where it runs is the router's decision (`router.py`), made in `start`; the client
sees it in `x-edgeserve-worker` and `x-edgeserve-route` with workers named by an
opaque tag (`worker_tag`), never by address; the logs keep the addresses. A worker
that fails before admitting the request (unreachable, or gone before the HTTP
200), or refuses it for capacity (its wait queue full, or the tenant's share of it:
a 429 from a heartbeat-old view of its load), is retried once on the decision's
second candidate; after admission a failure ends the stream with an error, since
tokens may already have been shown.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import NamedTuple

import anyio

from backend.errors import BackendUnavailable, CapacityError, EdgeServeError
from backend.protocol import ErrorEvent, Event, FinishEvent, GenerateRequest, Logprobs, TokenEvent
from backend.sampling_params import SamplingParams
from backend.worker_client import WorkerClient
from gateway.envelopes import as_typed, redact
from gateway.metering import Meter, UsageRecord
from gateway.metrics import GatewayMetrics
from gateway.quotas import Quotas, Reservation, has_quotas
from gateway.router import RouteDecision, Router
from gateway.served_models import ServedModel
from gateway.tenants import Tenant
from gateway.text_stream import TextStream
from gateway.worker_pool import WorkerPool

__all__ = ["Delta", "Done", "Usage", "Generation", "worker_tag"]

log = logging.getLogger(__name__)


class Usage(NamedTuple):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    def to_dict(self) -> dict[str, object]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


class Delta(NamedTuple):
    """Text released now; with logprobs asked for, the token ids that arrived and their logprobs
    (text may lag its tokens by what the detokeniser and stop strings hold back, or be "")."""

    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: Logprobs | None = None


class Done(NamedTuple):
    finish_reason: str  # "stop" | "length"
    usage: Usage


_Item = Delta | Done | EdgeServeError


class Generation:
    def __init__(self, *, tenant: Tenant, model: ServedModel, prompt_ids: list[int], params: SamplingParams,
                 api: str, region: str, router: Router, pool: WorkerPool, quotas: Quotas, meter: Meter,
                 metrics: GatewayMetrics, keep_special_ids: frozenset[int] = frozenset(), stream: bool = True) -> None:
        """`stream=False`: the response is read whole (`collect`), so the text is decoded once, at the end,
        and the only items are one Delta and the Done (`TextStream` with `incremental=False`)."""
        self.request_id = uuid.uuid4().hex
        self.tenant, self.model, self.prompt_ids, self.params, self.api = tenant, model, prompt_ids, params, api
        self.requested_max_tokens = params.max_tokens  # `params.max_tokens` is lower when the day's quota caps it
        self.region = region
        self.keep_special_ids = keep_special_ids  # special tokens whose text the response's parsers read
        self.stream = stream
        self._router, self._pool, self._quotas, self._meter, self._metrics = router, pool, quotas, meter, metrics
        self.route: RouteDecision | None = None
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._accepted = asyncio.Event()
        self._started: asyncio.Future[None] | None = None  # done once a worker took it or the producer ended
        self._producer: asyncio.Task[None] | None = None
        self._ended = False  # the final item (Done or an error) is queued: nothing left to cancel
        self._final: asyncio.Future[None] | None = None  # done once the final item is queued (`ended`)
        self._settling: asyncio.Future[None] | None = None  # the metering, once the producer ends
        self._reservation: Reservation | None = None
        self._completion_tokens = 0
        self._started_at = time.time()
        self.worker_url: str | None = None  # for the logs; clients see `worker_tag(worker_id)`
        self.worker_id: str | None = None
        self.token_ids: list[int] = []  # generated ids, kept when the request asks for logprobs
        self.logprobs: Logprobs | None = None  # theirs, accumulated
        self.prompt_logprobs: Logprobs | None = None  # prompt tokens 1.., set before the first item

    async def start(self) -> None:
        """Admit against quotas and get the request accepted by a worker; raise typed refusals."""
        await self._admit_and_route()
        if self._reservation.max_tokens < self.params.max_tokens:  # the day's tokens cap the completion
            self.params = SamplingParams(**{**_fields(self.params), "max_tokens": self._reservation.max_tokens})
        log.info("route %s: %s", self.request_id, self.route.reason)
        loop = asyncio.get_running_loop()
        self._started, self._final = loop.create_future(), loop.create_future()
        self._producer = asyncio.create_task(self._produce(), name=f"generation-{self.request_id}")
        self._producer.add_done_callback(self._on_started)
        await self._started
        if not self._accepted.is_set():  # the producer ended before a worker took the request
            item = self._queue.get_nowait()
            assert isinstance(item, EdgeServeError), item
            raise item

    async def _admit_and_route(self) -> None:
        """Quota admission and routing side by side (module docstring); the quota's refusal wins."""
        admit = self._quotas.admit(self.tenant, self.request_id, len(self.prompt_ids), self.params.max_tokens)
        admission: asyncio.Future[Reservation] | None = None
        if has_quotas(self.tenant):
            admission = asyncio.ensure_future(admit)
        else:  # admitted without a round trip: nothing to overlap
            self._reservation = await admit
        try:
            self.route = await self._router.route(self.model.name, self.tenant.id, self.prompt_ids,
                                                  self.params.max_tokens, self.region, self.request_id)
        except BaseException as exc:
            refused: BaseException | None = None
            with anyio.CancelScope(shield=True):  # also when cancelled: an admitted reservation goes back
                if admission is not None:
                    await asyncio.wait({admission})
                    refused = admission.exception()
                    self._reservation = admission.result() if refused is None else None
                if self._reservation is not None:
                    await self._meter.release(self._reservation)
            if isinstance(refused, EdgeServeError) and not isinstance(exc, asyncio.CancelledError):
                raise refused from None
            raise
        if admission is not None:
            try:
                self._reservation = await admission
            except BaseException:
                self._router.done(self.request_id)
                raise

    def _end(self, item: Done | EdgeServeError) -> None:
        """Queue the final item: nothing is left to cancel, and `ended` completes."""
        self._ended = True
        self._queue.put_nowait(item)
        if self._final is not None and not self._final.done():
            self._final.set_result(None)

    @property
    def final(self) -> asyncio.Future[None]:
        """Done once the final item (Done or an error) is queued, so `collect` returns at once (after
        `start`). Wait on it; never cancel it."""
        assert self._final is not None, "start() first"
        return self._final

    def _on_started(self, _: object = None) -> None:
        """The worker took the request (`on_accept`), or the producer ended without that."""
        if self._started is not None and not self._started.done():
            self._started.set_result(None)

    @property
    def reservation(self) -> Reservation | None:
        """What quota admission granted and left (None before `start`)."""
        return self._reservation

    @property
    def capped_by_quota(self) -> bool:
        """Whether the tenant's tokens per day lowered `max_tokens` below what the client asked."""
        return self.params.max_tokens < self.requested_max_tokens

    def public_headers(self) -> dict[str, str]:
        """Response headers for the client: the request id, the worker's opaque tag, and the routing
        decision with every worker named by its tag instead of its id or URL (`worker_tag`)."""
        if self.route is None:
            return {"x-edgeserve-request-id": self.request_id}
        records = [r for t in self.route.candidates for r in (t.worker, t.prefill) if r is not None]
        names = {name: worker_tag(r.id) for r in records for name in (r.id, r.url)}
        reason = self.route.reason
        for name in sorted(names, key=len, reverse=True):  # a URL before the id it contains
            reason = reason.replace(name, names[name])
        return {"x-edgeserve-request-id": self.request_id,
                "x-edgeserve-worker": worker_tag(self.worker_id or self.route.candidates[0].worker.id),
                "x-edgeserve-route": redact(reason)}

    async def events(self) -> AsyncIterator[Delta | Done]:
        """Text deltas, then one Done; a failure after admission raises its typed error."""
        while True:
            item = await self._queue.get()
            if isinstance(item, EdgeServeError):
                raise item
            yield item
            if isinstance(item, Done):
                return

    async def collect(self) -> tuple[str, Done]:
        """The whole completion text and its Done (non-streaming responses)."""
        parts: list[str] = []
        async for item in self.events():
            if isinstance(item, Delta):
                parts.append(item.text)
            else:
                return "".join(parts), item
        raise EdgeServeError("generation ended without a result")

    async def next_item(self, timeout: float) -> Delta | Done | EdgeServeError | None:
        """The next item, or None after `timeout` seconds without one (for keep-alives)."""
        if self._queue.empty():
            try:
                async with asyncio.timeout(timeout):  # a timer, not wait_for's extra task per item
                    return await self._queue.get()
            except TimeoutError:
                return None
        return self._queue.get_nowait()

    async def next_items(self, timeout: float) -> list[Delta | Done | EdgeServeError]:
        """Every item queued now, waiting up to `timeout` seconds for the first; [] when none came."""
        first = await self.next_item(timeout)
        if first is None:
            return []
        items = [first]
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        return items

    async def aclose(self) -> None:
        """Cancel the run if it has not finished, and wait until it is metered."""
        producer = self._producer
        if producer is None:
            return
        with anyio.CancelScope(shield=True):  # a client disconnect cancels us; this must still finish
            if not producer.done() and not self._ended:  # ended: only the metering is left, let it run
                producer.cancel()
            await asyncio.wait({producer})
            if self._settling is not None:
                await asyncio.wait({self._settling})

    # -- producer task -----------------------------------------------------------------
    async def _produce(self) -> None:
        finish_reason, error = "cancelled", None
        cached = 0
        client: WorkerClient | None = None
        try:
            candidates = self.route.candidates[:2]
            for attempt, target in enumerate(candidates):
                client = self._pool.client(target.worker.url)
                self.worker_url, self.worker_id = client.base_url, target.worker.id
                request = GenerateRequest(self.prompt_ids, self.params, self.request_id, model=self.model.name,
                                          cache_salt=self.tenant.id,  # tenants never share cached blocks
                                          prefill_url=target.prefill.url if target.prefill is not None else None,
                                          stream=self.stream)  # not streamed: the worker may write tokens together
                try:
                    finish_reason, cached = await self._stream_from(client, request)
                    break
                except (BackendUnavailable, CapacityError) as exc:
                    if self._accepted.is_set() or attempt == len(candidates) - 1:
                        raise
                    log.warning("worker %s %s %s; retrying on the next", client.base_url,
                                "refused for capacity" if isinstance(exc, CapacityError) else "failed before accepting",
                                self.request_id)
        except asyncio.CancelledError:
            if client is not None and self._accepted.is_set():
                await client.cancel(self.request_id)
            raise
        except BaseException as exc:  # noqa: BLE001 - every failure becomes a typed item
            error = as_typed(exc)
            finish_reason = "error"
            self._end(error)
        finally:
            # its own task, shielded: cancelling the producer (client gone) never cancels the metering
            self._settling = asyncio.ensure_future(self._settle(finish_reason, error, cached))
            await asyncio.shield(self._settling)

    async def _stream_from(self, client: WorkerClient, request: GenerateRequest) -> tuple[str, int]:
        text = TextStream(self.model.tokenizer, self.prompt_ids, self.params.stop, self.keep_special_ids,
                          incremental=self.stream)
        events = client.generate(request, on_accept=self._accept)
        async with contextlib.aclosing(events):
            return await self._consume(events, text, client)

    def _accept(self) -> None:
        self._accepted.set()
        self._on_started()

    async def _consume(self, events: AsyncIterator[Event], text: TextStream, client: WorkerClient) -> tuple[str, int]:
        first = True
        async for ev in events:
            if isinstance(ev, TokenEvent):
                if first:
                    self._metrics.observe_ttft(self.api, time.time() - self._started_at)
                    self._router.prefilled(self.request_id)  # its prompt no longer waits on the worker
                    first = False
                self._completion_tokens += len(ev.token_ids)
                if ev.prompt_logprobs is not None:
                    self.prompt_logprobs = ev.prompt_logprobs
                piece = text.push(ev.token_ids)
                if ev.logprobs is not None:
                    self.token_ids += ev.token_ids
                    if self.logprobs is None:
                        self.logprobs = Logprobs([])
                    self.logprobs.extend(ev.logprobs)
                    if self.stream:
                        self._queue.put_nowait(Delta(piece, tuple(ev.token_ids), ev.logprobs))
                elif piece:
                    self._queue.put_nowait(Delta(piece))
            elif isinstance(ev, FinishEvent):
                self._completion_tokens = ev.completion_tokens
                tail = text.finish()
                if tail:
                    self._queue.put_nowait(Delta(tail))
                reason = "length" if ev.finish_reason == "length" else "stop"
                usage = Usage(len(self.prompt_ids), ev.completion_tokens, ev.cached_tokens)
                self._end(Done(reason, usage))
                return reason, ev.cached_tokens
            elif isinstance(ev, ErrorEvent):
                self._completion_tokens = max(self._completion_tokens, ev.completion_tokens)
                raise _worker_error(ev)
        raise BackendUnavailable(f"worker {client.base_url} ended the stream without a final event")

    async def _settle(self, finish_reason: str, error: EdgeServeError | None, cached: int) -> None:
        """Meter once (or release the reservation when no worker ever took the request)."""
        self._router.done(self.request_id)
        try:
            if not self._accepted.is_set():
                if self._reservation is not None:
                    await self._meter.release(self._reservation)
                return
            record = UsageRecord(
                request_id=self.request_id, tenant_id=self.tenant.id, model=self.model.name,
                prompt_tokens=len(self.prompt_ids), cached_prompt_tokens=cached,
                completion_tokens=self._completion_tokens, finish_reason=finish_reason,
                error_code=error.code if error is not None else None,
                started_at=self._started_at, ended_at=time.time())
            await self._meter.record(record, self._reservation)
            log.info("request %s tenant %s model %s worker %s: %s, %d prompt + %d completion tokens",
                     self.request_id, self.tenant.id, self.model.name, self.worker_url, finish_reason,
                     len(self.prompt_ids), self._completion_tokens)
            self._metrics.observe_finished(self.api, self.model.name, finish_reason, len(self.prompt_ids),
                                           self._completion_tokens)
        except Exception:  # metering must never take the response down with it; it is logged loudly
            log.exception("metering failed for request %s (tenant %s)", self.request_id, self.tenant.id)


def worker_tag(worker_id: str) -> str:
    """The name clients see for a worker: `w-` and 12 hex digits of a hash of its registry id, stable
    across gateways, so a benchmark or an operator can match it, but no URL or address. (A worker id
    is `host:port` by default; ids chosen at random make the tag unguessable too.)"""
    return "w-" + hashlib.blake2b(worker_id.encode(), digest_size=6).hexdigest()


def _worker_error(ev: ErrorEvent) -> EdgeServeError:
    from backend.errors import error_from_code

    return error_from_code(ev.code, ev.message)


def _fields(params: SamplingParams) -> dict[str, object]:
    return {f: getattr(params, f) for f in params.__struct_fields__}
