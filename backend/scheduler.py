"""Continuous batching with chunked prefill and page-reserving admission.

Each step's batch is built decode-first: every running sequence that finished
its prompt contributes one token, then the remaining token budget
(`max_num_batched_tokens`) goes to prompt chunks (at most `prefill_chunk_size`
tokens each), first of sequences already prefilling, then of newly admitted ones.
So a long prompt is split over steps and running decodes never stall behind it.
Where the engine sets `mixed_step_tokens`, a step that carries decode rows holds at
most that many tokens: on a CPU whose bf16 linears run the C GEMV up to
`cpu_gemv.max_rows()` rows, a step just past that limit runs torch's GEMM at a worse
rate per row, so a new prompt arriving among running decodes is cut to fit (its
rest goes in the next steps, which also decode); with no decode rows, or too little
room left for prompts (`MIN_MIXED_PROMPT_TOKENS`), the full budget applies.
A lone prompt (no other sequence running, none waiting but on its blocks) may take the whole
budget in one chunk: the chunk size exists so that other sequences' tokens do not wait behind a
long prompt, and there are none (SmolLM2 in bfloat16 on a 2-core AMX Xeon, a 1,024-token
prompt alone: 0.44 s in chunks of 256, 0.34 s in steps of 512). A second arrival puts
both back on `prefill_chunk_size` chunks from the next step.

Admission reserves every page a request may need (prompt + max_tokens) up front,
and stops at the first request that does not fit: the pool is never over-committed,
so a running request can never run out of pages and nothing has to be preempted. A
request that could never fit, or arrives to a full wait queue, is refused at once
with CapacityError.

Tenants share admission (`fair_tenants`, on): first come first served within a
tenant, and between tenants the next request is the oldest of the tenant with the
fewest running sequences (those admitted in the same step counted), of those the one
admitted least recently (round robin), so one tenant's flood of requests does not
queue everyone else's behind it: a request from a tenant with nothing running goes
first at the next step with room, even where the flood has nothing running either.
The tenant is the gateway's tenant id (`Sequence.tenant`, from the request's
`cache_salt`); requests without one are one tenant, first come first served. Nor
does one tenant fill the wait queue: a tenant may hold at most `max_waiting -
max_waiting // 4` of its places (`tenant_waiting_limit`), so the others still find
room (192 of 256; a request past its share is refused with CapacityError, as past a
full queue). Requests without a tenant are not limited so.

Prefix cache (optional, `prefix_cache_pool.py`): admission first shares the
pages of the prompt's longest cached prefix (whole blocks, at most all but the
last prompt token, so at least one token is computed and yields logits), and
allocates only the rest; pages of unreferenced cached blocks are evicted (LRU)
when the free list is short. A prompt's full blocks enter the cache as its chunks
complete (`prompt_progress`), not only once the whole prompt is in.

Shared prefixes in flight: a waiting request whose next uncached block is one a
running prompt is still computing (same hash: same tenant, same tokens up to it)
is passed over, not admitted, until that prompt's chunks have put the blocks they
share in the cache; then it is admitted with them as hits. A burst of requests with
one new system prompt computes the prompt once, not once per request (two at once
computing the same 1,024 tokens side by side each take the time of both). Requests
behind a passed-over one are admitted as usual (at most `MAX_PASSED_OVER` are passed
over a step, which bounds the scan). A running prompt that only such requests wait on
counts as alone (the whole budget per chunk, below): they wait for it either way.

Disaggregation: a decode worker `reserve`s all of a request's pages before its
KV is sent (a transfer never lands in a full pool), then `activate`s it once
installed, and it joins the running batch as a decode. A prefill worker's
requests may `hold_pages`: on finishing they move to `held` with their pages
until `release_held` (after the KV is sent).

Thread-safety: `add`, `abort`, `reserve`, `release_reserved`, `activate` and
`release_held` may be called from any thread; everything else runs on the engine
thread. The lock guards `waiting`, `held`, the activation list, the abort set and
every status change of a reserved sequence (RECEIVING -> RUNNING in `take_activated`,
RECEIVING -> FINISHED in `release_reserved`), so a reservation released by its reader
after `activate` either never runs or was already running (then the reader aborts it).
Pages are taken with the allocator's one-step `try_allocate` (its own lock), so an
admission racing a reservation never finds the pages it counted gone.

When the engine thread stops, `close` ends every request it knows of, returns what
pages it can, and makes `add` and `reserve` raise the stopping error from then on.

A second prefix-cache tier (the cluster's KV store, `kv_store_tier.py`) hooks in at two
points: `prompt_listeners` hear of every prompt whose KV is complete (its blocks are
put to the store), and a request whose blocks are being fetched from the store is
checked with `check_room` when it arrives and `add`ed once they are installed.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

from backend.errors import CapacityError, EdgeServeError, PromptTooLong
from backend.page_allocator import PageAllocator
from backend.prefix_cache_pool import PrefixCachePool
from backend.sequence import Sequence, SequenceStatus

__all__ = ["SchedulerConfig", "ScheduledBatch", "Scheduler"]

log = logging.getLogger(__name__)


MIN_MIXED_PROMPT_TOKENS = 32  # below this room for prompts a mixed step is not capped (prompts would crawl)
MAX_PASSED_OVER = 32  # waiting requests passed over in one step while they wait for a prefix in flight
MAX_TENANTS_REMEMBERED = 4096  # tenants whose last admission is kept for the round robin (then pruned)


@dataclass(frozen=True)
class SchedulerConfig:
    max_model_len: int  # context limit: prompt + output tokens
    max_num_seqs: int = 64  # running sequences at once
    max_num_batched_tokens: int = 512  # tokens per step, decode + prefill
    prefill_chunk_size: int = 256
    max_waiting: int = 256  # bounded wait queue
    # tokens a step that carries decode rows holds at most (None: max_num_batched_tokens), while that leaves
    # prompt chunks at least MIN_MIXED_PROMPT_TOKENS; the engine sets it where steps up to that size run a
    # faster kernel (the bf16 C GEMV: module docstring)
    mixed_step_tokens: int | None = None
    # with a prefix cache: a waiting request whose prefix a running prompt is computing waits for its blocks
    # (module docstring); False computes it side by side (for comparison: `edgeserve bench prefix-burst`)
    wait_for_shared_prefix: bool = True
    # admission shared between tenants (module docstring); False: first come first served across tenants too
    fair_tenants: bool = True

    def step_limit(self, decode_rows: int) -> int:
        """Tokens a step that carries `decode_rows` decode rows may hold: `mixed_step_tokens` where it is set and
        leaves prompts at least MIN_MIXED_PROMPT_TOKENS, else `max_num_batched_tokens`."""
        mixed = self.mixed_step_tokens
        if decode_rows and mixed and mixed - decode_rows >= MIN_MIXED_PROMPT_TOKENS:
            return min(self.max_num_batched_tokens, mixed)
        return self.max_num_batched_tokens


class ScheduledBatch(NamedTuple):
    decode: list[Sequence]  # one token each
    prefill: list[tuple[Sequence, int]]  # (sequence, prompt tokens this step)
    aborted: list[Sequence]  # cancelled since the last step; pages already returned

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill

    @property
    def num_tokens(self) -> int:
        """Tokens the model runs this step: one per decode sequence plus the prompt tokens scheduled."""
        return len(self.decode) + sum(n for _, n in self.prefill)


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: PageAllocator, page_size: int,
                 prefix_cache: PrefixCachePool | None = None) -> None:
        self.config = config
        self.allocator = allocator
        self.page_size = page_size
        self.prefix_cache = prefix_cache
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.held: dict[str, Sequence] = {}  # prefill role: finished, pages kept until sent
        self._activated: list[Sequence] = []
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._abort_ids: set[str] = set()
        self.cache_stats = {"query_tokens": 0, "hit_tokens": 0}
        self._admissions = 0  # engine thread: admissions so far, and each tenant's last (`_admission_order`)
        self._last_admitted: dict[str, int] = {}
        self.closed: EdgeServeError | None = None  # set by `close`: the engine thread stopped
        # engine thread: called with each sequence whose whole prompt is in the cache (after the prefix cache)
        self.prompt_listeners: list[Callable[[Sequence], None]] = []

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # -- any thread ------------------------------------------------------------------
    def validate(self, seq: Sequence) -> None:
        """Raise PromptTooLong / CapacityError if `seq` can never run here."""
        cfg = self.config
        if seq.num_prompt_tokens == 0:
            raise PromptTooLong("empty prompt", prompt_tokens=0)
        if seq.num_prompt_tokens >= cfg.max_model_len:
            raise PromptTooLong(
                f"prompt has {seq.num_prompt_tokens} tokens; the context limit is {cfg.max_model_len} "
                "(prompt + at least one output token)",
                prompt_tokens=seq.num_prompt_tokens, max_model_len=cfg.max_model_len)
        if seq.max_total_tokens > cfg.max_model_len:
            raise PromptTooLong(
                f"prompt ({seq.num_prompt_tokens}) + max_tokens ({seq.params.max_tokens}) exceeds the context "
                f"limit {cfg.max_model_len}", prompt_tokens=seq.num_prompt_tokens, max_model_len=cfg.max_model_len)
        if self.pages_for(seq.max_total_tokens) > self.allocator.num_pages:
            raise CapacityError(f"request needs {self.pages_for(seq.max_total_tokens)} KV pages; the pool has "
                                f"{self.allocator.num_pages}", pool_pages=self.allocator.num_pages)

    def check_open(self) -> None:
        """Raise (a fresh copy of) the stopping error once `close` has run."""
        err = self.closed
        if err is not None:
            raise type(err)(err.message, **err.details)

    def add(self, seq: Sequence) -> None:
        """Queue a request, or raise PromptTooLong / CapacityError without queueing it."""
        self.validate(seq)
        seq.cached_on_arrival = self.page_size * self._cached_blocks(seq)
        with self._lock:
            self._check_room(0, seq.tenant)
            self.waiting.append(seq)
        self._wakeup.set()

    def check_room(self, seq: Sequence, pending: int) -> None:
        """Raise what `add` would (PromptTooLong, CapacityError, the stopping error) for a request that
        will be added later, counting `pending` such requests as already waiting; queue nothing."""
        self.validate(seq)
        with self._lock:
            self._check_room(pending, seq.tenant)

    @property
    def tenant_waiting_limit(self) -> int:
        """Places of the wait queue one tenant may hold (module docstring)."""
        return self.config.max_waiting - self.config.max_waiting // 4

    def _check_room(self, pending: int, tenant: str) -> None:
        """Under the lock: refuse when closed, when the wait queue (plus `pending`) is full, or when `tenant`
        holds its share of it."""
        self.check_open()
        cfg = self.config
        if len(self.waiting) + pending >= cfg.max_waiting:
            raise CapacityError(f"wait queue full ({cfg.max_waiting} requests)", max_waiting=cfg.max_waiting)
        limit = self.tenant_waiting_limit
        if tenant and len(self.waiting) >= limit and sum(s.tenant == tenant for s in self.waiting) >= limit:
            raise CapacityError(f"this tenant holds {limit} of the wait queue's {cfg.max_waiting} places, its "
                                "share; retry shortly", max_waiting=cfg.max_waiting, tenant_waiting_limit=limit)

    def wake(self) -> None:
        """Wake the engine thread (any thread): something it waits for has happened."""
        self._wakeup.set()

    def reserve(self, seq: Sequence) -> bool:
        """Decode role: take every page `seq` may need for its incoming KV; False if not free now.
        Raises the stopping error once the scheduler is closed."""
        self.check_open()
        pages = self.allocator.try_allocate(self.pages_for(seq.max_total_tokens))
        if pages is None:
            return False
        with self._lock:
            seq.page_ids, seq.page_tags = pages, self.allocator.tags_of(pages)
            seq.status = SequenceStatus.RECEIVING
        return True

    def release_reserved(self, seq: Sequence) -> bool:
        """Give back the pages of a reservation whose KV never fully arrived, or that was activated
        but not yet taken by the engine (it will not run then). False, changing nothing, when there
        is no reservation (never reserved, released already, or running: abort it instead)."""
        with self._lock:
            if seq.status is not SequenceStatus.RECEIVING:
                return False
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "cancelled"
            if seq in self._activated:
                self._activated.remove(seq)
        self._release_owned(seq)
        return True

    def activate(self, seq: Sequence) -> None:
        """Its KV is installed: run it from the next step (the engine takes it with `take_activated`).
        After `close` this does nothing: the request keeps its reservation until `release_reserved`."""
        with self._lock:
            if seq.status is not SequenceStatus.RECEIVING:
                raise ValueError(f"request {seq.request_id} holds no reservation ({seq.status.value})")
            if self.closed is not None:
                return
            self._activated.append(seq)
        self._wakeup.set()

    def release_held(self, request_id: str) -> bool:
        """Prefill role: the KV of a held request has been sent (or will never be): free its pages."""
        with self._lock:
            seq = self.held.pop(request_id, None)
        if seq is None:
            return False
        self._release_owned(seq)
        self._wakeup.set()  # the engine thread republishes the pool's figures (`LLMEngine.snapshot`)
        return True

    def abort(self, request_id: str) -> None:
        """Ask for a request to end at the next step boundary (its pages return then)."""
        with self._lock:
            self._abort_ids.add(request_id)
        self._wakeup.set()

    def wait_for_work(self, timeout: float) -> None:
        """Block the engine thread until something is queued or aborted (or timeout)."""
        if not self.has_work():
            self._wakeup.wait(timeout)
        self._wakeup.clear()

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self._abort_ids or self._activated)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens admitted or waiting but not yet computed (routing load; racy reads are fine). A waiting
        request counts its prompt less the leading blocks the prefix cache held when it was queued
        (`cached_on_arrival`), which admission will take rather than compute: the gateway's router counts a
        request it sends by the overlap it found at that moment, and takes that much off at its first token, so
        a worker publishing whole prompts looked buried in work it would never do until its next record. (Read
        at arrival, not here: this runs every few steps, and a flood of long cached prompts would walk every
        block of every waiting prompt each time.) A decoding request adds nothing (its computed tokens are past
        its prompt)."""
        with self._lock:
            waiting = sum(s.num_prompt_tokens - s.cached_on_arrival for s in self.waiting)
        return waiting + sum(max(0, s.num_prompt_tokens - s.num_computed_tokens) for s in list(self.running))

    def _cache_limit(self, seq: Sequence) -> int:
        """How many leading prompt blocks admission may take from the prefix cache: every full block but one
        holding the last prompt token (one token is always computed); 0 without a cache, or when the request
        scores its prompt (every prompt token computed)."""
        if self.prefix_cache is None or not seq.block_hashes or seq.params.prompt_logprobs is not None:
            return 0
        return (seq.num_prompt_tokens - 1) // self.page_size

    def _cached_blocks(self, seq: Sequence) -> int:
        """Leading prompt blocks of `seq` the prefix cache holds now (a hint: `match` at admission counts)."""
        limit = self._cache_limit(seq)
        return self.prefix_cache.leading_cached(seq.block_hashes, limit) if limit else 0  # type: ignore[union-attr]

    # -- engine thread ---------------------------------------------------------------
    def finish(self, seq: Sequence, reason: str) -> None:
        """End a running sequence: mark it and return its pages at once (or hold them, see `hold_pages`).

        Only pages whose tag still matches are released: a page that changed hands
        under the sequence (an integrity failure) belongs to someone else now."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.running.remove(seq)
        if seq.hold_pages and reason in ("stop", "length"):
            seq.status = SequenceStatus.HELD
            with self._lock:
                self.held[seq.request_id] = seq
            return
        self._release_owned(seq)

    def _release_owned(self, seq: Sequence) -> None:
        current = self.allocator.tags_of(seq.page_ids)
        self.allocator.release([p for p, want, have in zip(seq.page_ids, seq.page_tags, current) if want == have])
        seq.page_ids, seq.page_tags = [], []

    def take_activated(self) -> list[Sequence]:
        """Engine thread: sequences whose KV arrived since the last step, now running."""
        with self._lock:
            seqs, self._activated = self._activated, []
            for s in seqs:  # all RECEIVING: `release_reserved` takes a sequence out of the list
                s.status = SequenceStatus.RUNNING
        self.running.extend(seqs)
        return seqs

    def held_since(self, limit: float) -> list[str]:
        """Ids of held requests that finished (or arrived, if they never sampled) before `limit`."""
        with self._lock:
            return [rid for rid, s in self.held.items() if (s.first_token_time or s.arrival_time) < limit]

    def prompt_progress(self, seq: Sequence, computed_before: int) -> None:
        """Engine thread: a chunk of `seq`'s prompt ran (it had `computed_before` tokens before it);
        offer the full blocks it completed to the prefix cache, so requests sharing them can start
        (the last chunk's too: blocks enter the cache once, as they complete)."""
        if self.prefix_cache is None or not seq.block_hashes:
            return
        ps = self.page_size
        first, end = computed_before // ps, min(seq.num_computed_tokens // ps, len(seq.block_hashes))
        if end > first:
            self.prefix_cache.insert_blocks(seq.block_hashes[first:end],
                                            [seq.prompt_ids[i * ps:(i + 1) * ps] for i in range(first, end)],
                                            seq.page_ids[first:end])

    def prompt_computed(self, seq: Sequence) -> None:
        """Engine thread: `seq`'s whole prompt is in the KV cache (its full blocks already offered to the
        prefix cache, `prompt_progress`); tell the listeners."""
        for listener in self.prompt_listeners:
            listener(seq)

    def _reap_aborted(self) -> list[Sequence]:
        with self._lock:
            ids, self._abort_ids = self._abort_ids, set()
            if not ids:
                return []
            dropped = [s for s in self.waiting if s.request_id in ids]
            for s in dropped:
                self.waiting.remove(s)
                s.status, s.finish_reason = SequenceStatus.FINISHED, "cancelled"
            # finished into `held` in the step that raced with the abort: its KV will never be collected
            held = [self.held.pop(rid) for rid in ids if rid in self.held]
        for s in held:
            self._release_owned(s)
        for s in [s for s in self.running if s.request_id in ids]:
            self.finish(s, "cancelled")
            dropped.append(s)
        return dropped

    def schedule(self) -> ScheduledBatch:
        """Pick this step's tokens; admit waiting requests whose pages are free."""
        cfg = self.config
        aborted = self._reap_aborted()
        decode = [s for s in self.running if not s.is_prefilling]
        limit = cfg.step_limit(len(decode))
        budget = limit - len(decode)
        chunk = cfg.prefill_chunk_size
        with self._lock:  # the requests this step may admit (later arrivals wait for the next step)
            waiting = list(self.waiting)
        in_flight = self._blocks_in_flight(waiting)
        # a lone prompt: no one's tokens wait behind it (those waiting for its blocks wait either way)
        if not decode and (len(self.running) + len(waiting) == 1 or (
                len(self.running) == 1 and 0 < len(waiting) <= MAX_PASSED_OVER
                and all(self._waits_for(s, in_flight) for s in waiting))):
            chunk = limit
        prefill: list[tuple[Sequence, int]] = []
        for s in self.running:
            if budget <= 0:
                break
            if s.is_prefilling:
                n = min(s.num_prompt_tokens - s.num_computed_tokens, chunk, budget)
                prefill.append((s, n))
                budget -= n
        passed = 0  # waiting requests passed over: they wait for blocks a running prompt is computing
        for seq in self._admission_order(waiting):
            if budget <= 0 or len(self.running) >= cfg.max_num_seqs:
                break
            if self._waits_for(seq, in_flight):
                passed += 1
                if passed == MAX_PASSED_OVER:
                    break
                continue
            pages = self._admit_pages(seq)
            if pages is None:
                break
            with self._lock:  # other threads only append to `waiting`
                self.waiting.remove(seq)
                seq.page_ids, seq.page_tags = pages, self.allocator.tags_of(pages)
                seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if in_flight is not None and seq.block_hashes:
                in_flight.update(seq.block_hashes[seq.num_computed_tokens // self.page_size:])
            n = min(seq.num_prompt_tokens - seq.num_computed_tokens, chunk, budget)
            prefill.append((seq, n))
            budget -= n
        return ScheduledBatch(decode, prefill, aborted)

    def _admission_order(self, waiting: list[Sequence]) -> Iterator[Sequence]:
        """`waiting` (in arrival order) in the order admission considers them: first come first served within a
        tenant; between tenants (`fair_tenants`) the oldest request of the tenant with the fewest running
        sequences, counting each one admitted since (a yielded request found RUNNING on resuming), on a tie the
        tenant admitted least recently, then the earlier arrival."""
        if not self.config.fair_tenants or all(s.tenant == waiting[0].tenant for s in waiting):
            for seq in waiting:
                yield seq
                if seq.status is SequenceStatus.RUNNING:
                    self._admitted(seq.tenant)
            return
        queues: dict[str, deque[tuple[int, Sequence]]] = defaultdict(deque)
        for i, s in enumerate(waiting):
            queues[s.tenant].append((i, s))
        running = Counter(s.tenant for s in self.running)
        while queues:
            tenant = min(queues, key=lambda t: (running[t], self._last_admitted.get(t, -1), queues[t][0][0]))
            seq = queues[tenant].popleft()[1]
            if not queues[tenant]:
                del queues[tenant]
            yield seq
            if seq.status is SequenceStatus.RUNNING:
                running[tenant] += 1
                self._admitted(tenant)

    def _admitted(self, tenant: str) -> None:
        """Note `tenant`'s admission (its turn for the round robin); forget tenants with nothing queued or running
        once there are many."""
        self._last_admitted[tenant] = self._admissions
        self._admissions += 1
        if len(self._last_admitted) > MAX_TENANTS_REMEMBERED:
            with self._lock:
                present = {s.tenant for s in self.waiting}
            present.update(s.tenant for s in self.running)
            self._last_admitted = {t: n for t, n in self._last_admitted.items() if t in present}

    def _blocks_in_flight(self, waiting: list[Sequence]) -> set[bytes] | None:
        """Hashes of the full prompt blocks running prompts have yet to compute (`prompt_progress` puts each
        in the prefix cache once computed); None without a prefix cache or anyone `waiting`."""
        if self.prefix_cache is None or not waiting or not self.config.wait_for_shared_prefix:
            return None
        ps = self.page_size
        out: set[bytes] = set()
        for s in self.running:
            if s.is_prefilling and s.block_hashes:
                out.update(s.block_hashes[s.num_computed_tokens // ps:])
        return out

    def _waits_for(self, seq: Sequence, in_flight: set[bytes] | None) -> bool:
        """Whether `seq`'s next block past its cached prefix is one a running prompt is computing (then it
        is better admitted once that block is cached than computing it side by side)."""
        limit = self._cache_limit(seq)
        if not in_flight or not limit:
            return False
        cached = self._cached_blocks(seq)
        return cached < limit and seq.block_hashes[cached] in in_flight

    def _admit_pages(self, seq: Sequence) -> list[int] | None:
        """All pages `seq` needs, cached prefix first (shared), or None (nothing taken) if they do not fit."""
        needed = self.pages_for(seq.max_total_tokens)
        cache = self.prefix_cache
        hits: list[int] = []
        if limit := self._cache_limit(seq):
            hits = cache.match(seq.block_hashes, seq.prompt_ids, limit)  # type: ignore[union-attr]
        new = needed - len(hits)
        short = new - self.allocator.num_free
        if short > 0 and cache is not None:
            cache.evict(short)
        pages = self.allocator.try_allocate(new)  # a reservation may have taken free pages meanwhile
        if pages is None:
            if hits:
                self.allocator.release(hits)  # a shared page's tag is unchanged by this
            return None
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.page_size
        if cache is not None and seq.block_hashes:
            self.cache_stats["query_tokens"] += seq.num_prompt_tokens
            self.cache_stats["hit_tokens"] += seq.num_cached_tokens
        return hits + pages

    # -- the engine thread stopped ------------------------------------------------------------
    def close(self, err: EdgeServeError) -> list[Sequence]:
        """End every request (waiting, activated, running, held) with finish reason "error", return the
        pages each still owns and the prefix cache's, and refuse new work with `err` from now on.

        Called when the engine thread cannot go on, possibly with its state half-updated by the step
        that failed: each release is tried on its own and a failure is logged, not raised. Returns
        the requests ended. Reservations not yet activated stay with their owner's `release_reserved`."""
        with self._lock:
            self.closed = err
            waiting, self.waiting = list(self.waiting), deque()
            activated, self._activated = self._activated, []
            held = list(self.held.values())
            self.held.clear()
            self._abort_ids.clear()
        running, self.running = self.running, []
        ended = [*waiting, *activated, *running, *held]
        for s in ended:
            s.status, s.finish_reason = SequenceStatus.FINISHED, "error"
            try:
                self._release_owned(s)
            except Exception:  # noqa: BLE001 - free what can be freed
                log.exception("could not return the pages of %s", s.request_id)
        if self.prefix_cache is not None:
            try:
                self.prefix_cache.clear()
            except Exception:  # noqa: BLE001
                log.exception("could not return the prefix cache's pages")
        self._wakeup.set()
        return ended
