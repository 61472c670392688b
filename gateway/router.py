"""Where a request runs: region first, then prefix overlap against load, with a fallback.

    route(model, tenant, prompt_ids, max_tokens, region) -> RouteDecision(candidates, reason)

0. **Capacity.** Front workers are unified workers, and decode workers while a prefill
   worker is live (a decode worker alone cannot serve). None → `NoCapacity` (503,
   Retry-After), never an error from an empty list.
1. **Region.** Front workers are grouped
   by region and the regions ordered by distance from the request's region
   (`regions.py`). The first region with a live, unsaturated worker wins; when the
   nearest is down or saturated the request spills to the next nearest, and the
   reason says so. Saturated = its free pages, counting cached blocks nobody reads
   (evicted on demand), cannot hold prompt + max_tokens, or its waiting requests have
   reached `max_waiting`: the record's `waiting`, less those this gateway dispatched
   before the record that had their first token (or ended) since, plus those it sent
   since that have had none yet.
2. **Within the region**, by policy:
   - `prefix` (default): the request's block hashes (`prefix_cache.hashing`, salted
     with the tenant, so tenants never see each other's blocks) are looked up in the
     Redis index of the workers' own KV events; each prefill-capable worker gets
     `cost = queued prefill tokens + recompute_weight * prompt tokens it would compute
     (minus its cached overlap) + load_tokens * excess`, the lowest cost wins (ties: the
     less loaded). A token computed weighs `recompute_weight` (default 2) tokens queued:
     waiting behind a queue costs this request its time, computing costs that time too
     and as much again to the requests on that worker it delays, which queue time does
     not. With weight 1 a conversation's next turn chased any queue a little longer than
     its own remainder, and each such move queued a whole prompt on the new worker,
     which moved the next conversation cached there (`BENCHMARKS.md`, `bench routing`).
     At weight 2 a request waits, beyond the fastest start it could have had, at most
     as long as the recomputation it saves would take.
     `excess` is how many requests (running + waiting) the worker has beyond the least
     loaded candidate's `m`, less a slack of `max(load_slack, load_slack_share * m)`
     (default 2 requests or half of `m`; never below 0): a difference of a request or
     two comes and goes within one request's lifetime (a closed loop of users over a few
     workers fluctuates by that much all the time, and by more, about the square root of
     the load, on workers running tens of requests), and chasing it throws a
     conversation's cached blocks away for a balance that reverses a moment later; a
     lasting imbalance still counts. (SGLang's cache-aware router has the same two states:
     cache affinity until the load differs by more than an absolute threshold and by more
     than a ratio, then load; here both live in one cost.) A hot prefix therefore stays
     on its worker until the queue there outweighs twice the tokens saved, then spreads. Blocks
     the cluster's KV store holds beyond a worker's own overlap (the index's "store"
     tier) are fetched, not computed: each counts `store_token_cost` of a token (default
     0.25: between a local hit, 0, and a recompute, 1; `prefill_cost`). So with a store a
     hot prefix spreads at a quarter of the imbalance it needs without one.
   - `least-loaded`: fewest running + waiting (+ in flight from this gateway).
   - `round-robin`: in turn.
   In a disaggregated pool the prefill worker is chosen by that score and the decode
   worker by load (most free pages, fewest running).
   A region with one prefill-capable worker skips the index lookup (a Redis round trip: about
   0.2 ms of a request's added latency): that worker wins whatever it caches, and the decision
   counts no overlap for it (its in-flight prompt tokens count in full until it ends).
3. **Fallback.** The second-best target (same region, else the next region) is kept so
   a worker that fails before accepting the request is retried once elsewhere.

Load between heartbeats: the router remembers what it dispatched to each worker
until the request ends (`done`), and adds what was sent after the worker's last
record (requests and prompt tokens), so a burst within one refresh interval does
not all land on the worker that looked idlest. It also takes off what the record
still counts but has ended since (requests dispatched before the record was
written and ended after it): a conversation's next turn, sent the moment the last
one ends, otherwise finds its own worker loaded by that very turn for up to a
heartbeat and goes to a worker that must compute the whole prompt again. Prompt
tokens are corrected the same way, at the request's first token (`prefilled`; its end
if none came): a request dispatched before the record and prefilled after it is taken
off the record's `queued_prefill_tokens`, and one sent after it counts only until its
first token. Both sides count a request by the prompt tokens it leaves to compute (its
prompt less the cached prefix: the overlap here, the worker's own cache in the record), so
what is taken off is what the record counted. (A record is up to a heartbeat plus the
registry view's refresh old, about 1.5 s: longer than many prefills, so a worker that has
just worked through its queue otherwise looks buried for that long.) The first token of a non-streamed request can
reach the gateway up to 0.25 s after it was computed (the worker writes lines together),
so its tokens are taken off that much late. Static workers (no records) count
everything in flight.
"""

from __future__ import annotations

import itertools
import time
from collections import defaultdict, deque
from typing import NamedTuple

from backend.errors import NoCapacity
from backend.registration import WorkerRecord
from gateway.regions import RegionMap
from prefix_cache.hashing import block_hashes
from prefix_cache.kv_events import PrefixIndex, TierOverlap

__all__ = ["Target", "RouteDecision", "Router", "POLICIES", "prefill_cost", "STORE_TOKEN_COST", "LOAD_SLACK",
           "LOAD_SLACK_SHARE", "RECOMPUTE_WEIGHT"]

POLICIES = ("prefix", "least-loaded", "round-robin")
LOAD_SLACK = 2  # requests of load difference the prefix policy ignores (see the module docstring)
LOAD_SLACK_SHARE = 0.5  # ... or this share of the least loaded worker's load, when that is more
STORE_TOKEN_COST = 0.25  # a prompt token fetched from the KV store, against 1 computed and 0 cached locally
RECOMPUTE_WEIGHT = 2.0  # a prompt token computed, against 1 queued ahead of it (see the module docstring)


def prefill_cost(prompt_tokens: int, local_tokens: int, store_tokens: int, store_token_cost: float = STORE_TOKEN_COST
                 ) -> float:
    """Tokens' worth of prefill work for a prompt of which the worker caches `local_tokens` leading tokens
    and the KV store holds `store_tokens` leading tokens (at least one token is always computed)."""
    local = min(local_tokens, prompt_tokens - 1)
    fetched = max(0, min(store_tokens, prompt_tokens - 1) - local)
    return (prompt_tokens - local - fetched) + store_token_cost * fetched


class Target(NamedTuple):
    worker: WorkerRecord  # receives /v1/generate (unified or decode)
    prefill: WorkerRecord | None = None  # disaggregated pools: who computes the prompt


class RouteDecision(NamedTuple):
    candidates: list[Target]  # best first; the second is the retry target
    reason: str
    region: str
    overlap_blocks: int = 0


ENDED_KEEP_S = 10.0  # how long an ended request is remembered: longer than a record lives (3 s TTL)


class _Sent:
    """One request this gateway sent to a worker: when, the prompt tokens it left to compute there, when
    those were computed (its first token, or its end if none came) and when it ended."""

    __slots__ = ("sent", "tokens", "computed_at", "ended_at")

    def __init__(self, tokens: int) -> None:
        self.sent, self.tokens = time.time(), tokens
        self.computed_at: float | None = None
        self.ended_at: float | None = None


class _InFlight:
    """Requests this gateway dispatched, per worker: those not ended, and those that ended in the last
    `ENDED_KEEP_S`."""

    def __init__(self) -> None:
        self.active: dict[str, dict[str, _Sent]] = defaultdict(dict)
        self.ended: dict[str, deque[_Sent]] = defaultdict(deque)

    def add(self, worker_id: str, request_id: str, tokens: int) -> None:
        self.active[worker_id][request_id] = _Sent(tokens)

    def prefilled(self, request_id: str) -> None:
        now = time.time()
        for requests in self.active.values():
            if (item := requests.get(request_id)) is not None and item.computed_at is None:
                item.computed_at = now

    def done(self, request_id: str) -> None:
        now = time.time()
        for worker_id, requests in self.active.items():
            if (item := requests.pop(request_id, None)) is not None:
                item.ended_at = now
                if item.computed_at is None:  # ended before its first token: it left the queue now
                    item.computed_at = now
                ended = self.ended[worker_id]
                ended.append(item)
                while ended[0].ended_at < now - ENDED_KEEP_S:
                    ended.popleft()

    def since(self, rec: WorkerRecord) -> _Since:
        """What changed on `rec`'s worker since `rec` was written, as far as this gateway knows, in one pass.
        Ended requests that ended before it was written are dropped: a worker's records only get newer, so
        no record will count them again. A static worker (no record) counts nothing itself: everything in
        flight is `sent`."""
        t = rec.updated_at
        ended = self.ended[rec.id]
        while ended and ended[0].ended_at <= t:
            ended.popleft()
        sent = sent_waiting = sent_tokens = gone = prefilled = computed = 0
        for item in self.active[rec.id].values():
            if item.sent > t:
                sent += 1
                if item.computed_at is None:
                    sent_waiting += 1
                    sent_tokens += item.tokens
            elif t and item.computed_at is not None and item.computed_at > t:
                prefilled += 1
                computed += item.tokens
        if t:
            for item in ended:
                if item.sent <= t:
                    gone += 1
                    if item.computed_at > t:
                        prefilled += 1
                        computed += item.tokens
        return _Since(sent, sent_waiting, sent_tokens, gone, prefilled, computed)


class _Since(NamedTuple):
    """A worker's changes since its record: requests sent after it (`sent`), those of them not yet prefilled
    (`sent_waiting`) and their prompt tokens (`sent_tokens`); requests it counts that have ended (`gone`); requests
    it counts that have been prefilled since (`prefilled`: a first token, or an end, after it was written) and the
    prompt tokens it counted as queued for them (`computed`)."""
    sent: int
    sent_waiting: int
    sent_tokens: int
    gone: int
    prefilled: int
    computed: int


class Router:
    def __init__(self, view, index: PrefixIndex | None, regions: RegionMap, *, policy: str = "prefix",
                 max_waiting: int = 16, load_tokens: int = 256, store_token_cost: float = STORE_TOKEN_COST,
                 load_slack: int = LOAD_SLACK, load_slack_share: float = LOAD_SLACK_SHARE,
                 recompute_weight: float = RECOMPUTE_WEIGHT) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}; choose from {POLICIES}")
        if load_slack < 0 or load_slack_share < 0:
            raise ValueError(f"load_slack (requests) and load_slack_share must be >= 0, got {load_slack}, "
                             f"{load_slack_share}")
        if recompute_weight < 1.0:
            raise ValueError(f"recompute_weight is a computed token's cost against a queued one (>= 1), got "
                             f"{recompute_weight}")
        if not 0.0 <= store_token_cost <= 1.0:
            raise ValueError(f"store_token_cost is a fraction of a computed token (0..1), got {store_token_cost}")
        self.view, self.index, self.regions, self.policy = view, index, regions, policy
        self.max_waiting, self.load_tokens, self.store_token_cost = max_waiting, load_tokens, store_token_cost
        self.load_slack, self.load_slack_share, self.recompute_weight = load_slack, load_slack_share, recompute_weight
        self._turn = itertools.count()
        self._inflight = _InFlight()

    def done(self, request_id: str) -> None:
        """The request ended: it no longer loads the workers it was sent to."""
        self._inflight.done(request_id)

    def prefilled(self, request_id: str) -> None:
        """The request's first token came: its prompt no longer waits in its worker's prefill queue."""
        self._inflight.prefilled(request_id)

    @staticmethod
    def _queued(w: WorkerRecord, since: _Since) -> int:
        """Prompt tokens waiting on `w` now: its record's, less what was computed since, plus what was sent since."""
        return max(0, w.queued_prefill_tokens - since.computed) + since.sent_tokens

    async def route(self, model: str, tenant_id: str, prompt_ids: list[int], max_tokens: int,
                    region: str, request_id: str) -> RouteDecision:
        workers = await self.view.workers(model)
        has_prefill = any(w.role == "prefill" for w in workers)
        # a decode worker serves only beside a live prefill worker: without one it is no candidate
        front = [w for w in workers if w.role == "unified" or (w.role == "decode" and has_prefill)]
        if not front:
            why = ("decode workers are registered but no prefill worker is live"
                   if any(w.role == "decode" for w in workers) else "no live worker serves it")
            raise NoCapacity(f"no capacity for model {model}: {why}; retry shortly", model=model,
                             retry_after_s=1)
        need = len(prompt_ids) + max_tokens
        since = self._since(workers)  # for the room checks and the ranking below (no await between them)
        by_region: dict[str, list[WorkerRecord]] = defaultdict(list)
        for w in front:
            by_region[w.region].append(w)
        order = self.regions.nearest_first(region, by_region)
        chosen_region, skipped = None, []
        for r in order:
            if any(self._has_room(w, need, since) for w in by_region[r]):
                chosen_region = r
                break
            skipped.append(r)
        if chosen_region is None:  # everything saturated: the nearest region queues it
            chosen_region = order[0]
        ranked, overlap, why = await self._rank(model, tenant_id, prompt_ids,
                                                [w for w in by_region[chosen_region] if self._has_room(w, need, since)]
                                                or by_region[chosen_region], workers, chosen_region, since)
        fallback = ranked[1:2]
        if not fallback:  # retry target from the next region with room
            for r in order:
                if r != chosen_region:
                    rest, _, _ = await self._rank(model, tenant_id, prompt_ids, by_region[r], workers, r,
                                                  self._since(workers))  # the first ranking awaited: read again
                    fallback = rest[:1]
                    break
        best = ranked[0]
        # what the winner will compute: the prompt less the blocks it already caches
        to_compute = len(prompt_ids) - overlap * (best.worker.page_size or 16)
        self._inflight.add(best.worker.id, request_id, to_compute if best.prefill is None else 0)
        if best.prefill is not None:
            self._inflight.add(best.prefill.id, request_id, to_compute)
        where = f"region {chosen_region}"
        if chosen_region != region:
            where += f" (request from {region}; " + (f"{', '.join(skipped)} saturated or down)" if skipped
                                                     else "nearest with workers)")
        return RouteDecision([best, *fallback], f"{where}; {why}", chosen_region, overlap)

    def _has_room(self, w: WorkerRecord, need: int, since: dict[str, _Since]) -> bool:
        if w.pages_total == 0:  # capacity unknown (static configuration)
            return True
        room = (w.pages_free + w.pages_evictable) * w.page_size  # cached blocks nobody reads are evicted on demand
        return room >= need and self._waiting(w, since[w.id]) < self.max_waiting

    @staticmethod
    def _waiting(w: WorkerRecord, since: _Since) -> int:
        """Requests waiting on `w` now: its record's, less those prefilled since, plus those sent since and not yet
        prefilled. A request counted running in the record (admitted, its prompt still in chunks) and prefilled
        since is taken off too, so this can read low by a few: the worker then refuses it for capacity and the
        gateway retries the next candidate, where reading high would pass a worker over for a record's lifetime."""
        return max(0, w.waiting - since.prefilled) + since.sent_waiting

    @staticmethod
    def _load(w: WorkerRecord, since: _Since) -> int:
        """Running + waiting requests on `w` now: its record's, plus what was sent since, less what ended since."""
        return max(0, w.running + w.waiting + since.sent - since.gone)

    def _since(self, workers: list[WorkerRecord]) -> dict[str, _Since]:
        """Each worker's changes since its record (`_InFlight.since`), read once for one decision. Read it again
        after an await: other requests routed meanwhile have been added."""
        return {w.id: self._inflight.since(w) for w in workers}

    async def _rank(self, model: str, tenant_id: str, prompt_ids: list[int],
                    front: list[WorkerRecord], workers: list[WorkerRecord], region: str, since: dict[str, _Since]
                    ) -> tuple[list[Target], int, str]:
        """Targets in `front`, best first, with the winner's prefix overlap (blocks) and the reason. `since` is
        `_since(workers)` read since the caller's last await; it is read again after the prefix-index lookup."""
        if not front:
            return [], 0, "no worker"
        prefills = [w for w in workers if w.role == "prefill" and w.region == region] or \
                   [w for w in workers if w.role == "prefill"]
        disaggregated = any(w.role == "decode" for w in front)
        if self.policy == "round-robin":
            k = next(self._turn)
            ordered = front[k % len(front):] + front[:k % len(front)]
            pre = prefills[k % len(prefills)] if disaggregated and prefills else None
            return [Target(w, pre) for w in ordered], 0, "policy round-robin"
        if self.policy == "least-loaded" or disaggregated:
            ordered = sorted(front, key=lambda w: (self._load(w, since[w.id]), -w.pages_free, w.id))
            if not disaggregated:
                best_load = self._load(ordered[0], since[ordered[0].id])
                return [Target(w) for w in ordered], 0, f"policy least-loaded (load {best_load})"
        # prefix-aware: score the prefill-capable workers (a sole one wins whatever it caches: no lookup)
        scorable = prefills if disaggregated else front
        sole = len(scorable) == 1
        if not sole:
            tiers = await self._overlap(model, tenant_id, prompt_ids, scorable)
            since = self._since(workers)  # what was routed while the lookup ran counts too
        else:
            tiers = TierOverlap({}, 0)
        overlap = tiers.local
        page = scorable[0].page_size or 16
        load = {w.id: self._load(w, since[w.id]) for w in scorable}
        least = min(load.values())
        floor = least + max(self.load_slack, self.load_slack_share * least)  # load up to here costs nothing

        def cost(w: WorkerRecord) -> float:
            store = tiers.store * page if w.kv_store else 0  # only a worker with the store can fetch
            work = prefill_cost(len(prompt_ids), overlap.get(w.id, 0) * page, store, self.store_token_cost)
            return (self._queued(w, since[w.id]) + self.recompute_weight * work
                    + self.load_tokens * max(0, load[w.id] - floor))

        costs = {w.id: cost(w) for w in scorable}
        if self.policy == "least-loaded":
            scored = sorted(scorable, key=lambda w: (load[w.id], w.id))
        else:
            scored = sorted(scorable, key=lambda w: (costs[w.id], load[w.id], w.id))
        best = scored[0]
        store = f", {tiers.store} in the KV store" if tiers.store else ""
        why = f"policy {self.policy}: {best.id} is the only candidate (prefix index not asked)" if sole else (
            f"policy {self.policy}: {overlap.get(best.id, 0)} cached blocks of {len(prompt_ids) // page} "
            f"on {best.id}{store}, cost {costs[best.id]:.0f} tokens ({self._load_parts(best, since[best.id])}); "
            f"next {scored[1].id}: cost {costs[scored[1].id]:.0f} ({overlap.get(scored[1].id, 0)} cached blocks, "
            f"{self._load_parts(scored[1], since[scored[1].id])})")
        if disaggregated:
            decodes = sorted(front, key=lambda w: (self._load(w, since[w.id]), -w.pages_free, w.id))
            targets = [Target(d, best) for d in decodes]
            if len(scored) > 1 and len(decodes) == 1:
                targets.append(Target(decodes[0], scored[1]))
            return targets, overlap.get(best.id, 0), why + f"; decode on {decodes[0].id} (load)"
        return [Target(w) for w in scored], overlap.get(best.id, 0), why

    def _load_parts(self, w: WorkerRecord, since: _Since) -> str:
        """A worker's queue and load as the cost counted them, for the decision's reason (logged at INFO): with
        the runner-up's beside the winner's, a conversation that left the worker caching it says why."""
        return f"{self._queued(w, since)} queued tokens, load {self._load(w, since)}"

    async def _overlap(self, model: str, tenant_id: str, prompt_ids: list[int],
                       workers: list[WorkerRecord]) -> TierOverlap:
        if self.index is None or not workers:
            return TierOverlap({}, 0)
        hashes = block_hashes(prompt_ids, workers[0].page_size or 16, tenant_id)
        return await self.index.overlap_tiers(model, hashes) if hashes else TierOverlap({}, 0)
