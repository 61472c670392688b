"""The engine thread under failure and concurrency: a step that raises anywhere, `fail_all`, racing
reservations, snapshots read while the prefix cache churns, held KV freed under its reader (fault (d)),
and the bounded KV-event list."""

from __future__ import annotations

import asyncio
import contextlib
import random
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
import torch

from backend.async_engine import AsyncEngine
from backend.distributed.collectives import Collectives, GroupFailure
from backend.engine import EngineConfig, LLMEngine
from backend.errors import Draining, EngineStopped, KVIntegrityError
from backend.fault_injection import free_held_and_reallocate
from backend.kv_transfer import FrameReader, KVBegin, KVError, KVLayer, PrefillRequest
from backend.protocol import ErrorEvent, Event, FinishEvent, TokenEvent
from backend.sampling_params import SamplingParams
from backend.sequence import Sequence
from backend.worker import create_worker_app
from tests.backend.servers import serve_in_thread
from tests.backend.tiny_models import write_tiny_model

GREEDY = dict(temperature=0.0, ignore_eos=True)
PROMPT = [(5 * i) % 300 + 3 for i in range(37)]
PAGE_BYTES = 16 * 3 * 2 * 2 * 16 * 4  # one fp32 page of the tiny model: tokens * layers * (K, V) * heads * dim * 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("hardening") / "m", "llama", seed=9)


def make(model_dir: Path, **kw) -> LLMEngine:
    cfg = dict(kv_cache_bytes=2**20, page_size=16, max_model_len=256, gemm_buckets=())
    cfg.update(kw)
    return LLMEngine.from_pretrained(model_dir, EngineConfig(**cfg))


@contextlib.contextmanager
def fast_thread_switching() -> Iterator[None]:
    """Switch threads every 10 us instead of 5 ms, so races show up within a short test."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


async def drain(stream: AsyncIterator[Event]) -> list[Event]:
    return [ev async for ev in stream]


def streamed_tokens(events: list[Event]) -> int:
    return sum(len(ev.token_ids) for ev in events if isinstance(ev, TokenEvent))


def wait_all_free(engine: LLMEngine, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.allocator.num_free != engine.allocator.num_pages:
        assert time.monotonic() < deadline, (engine.allocator.num_free, engine.allocator.num_pages)
        time.sleep(0.01)


# -- item 2: a step that raises anywhere -------------------------------------------------------------
def test_an_exception_outside_the_model_run_stops_the_engine_and_ends_every_request_at_once(model_dir: Path) -> None:
    engine = make(model_dir, max_num_seqs=2)
    aengine = AsyncEngine(engine)
    long = SamplingParams(max_tokens=200, **GREEDY)

    async def scenario() -> tuple[list[list[Event]], list[int], float]:
        held = await drain(aengine.submit(PROMPT, SamplingParams(max_tokens=1, **GREEDY), "held", hold=True))
        assert isinstance(held[-1], FinishEvent) and "held" in engine.scheduler.held
        streams = [aengine.submit(PROMPT, long, f"r{i}") for i in range(3)]  # two run, the third waits
        firsts = [await anext(s) for s in streams[:2]]
        receiving = engine.new_sequence(PROMPT, long, "receiving")  # decode role: its KV is on the way
        assert engine.reserve(receiving)
        streams.append(aengine.attach(receiving))
        assert engine.scheduler.num_waiting == 1 and aengine.num_active() == 4

        def broken_schedule():
            raise RuntimeError("injected: scheduler bug")

        engine.scheduler.schedule = broken_schedule  # type: ignore[method-assign]
        started = time.monotonic()
        rests = await asyncio.wait_for(asyncio.gather(*(drain(s) for s in streams)), timeout=10)
        elapsed = time.monotonic() - started
        with pytest.raises(EngineStopped):
            aengine.submit(PROMPT, long)
        with pytest.raises(EngineStopped):
            aengine.attach(engine.new_sequence(PROMPT, long))
        seen = [streamed_tokens([f] + r) if i < 2 else streamed_tokens(r)
                for i, (f, r) in enumerate(zip(firsts + [None, None], rests))]
        with pytest.raises(EngineStopped):  # the transfer stops at its next layer
            engine.install_kv(receiving, 0, *[torch.zeros(len(PROMPT), 2, 16)] * 2)
        assert engine.release_reserved(receiving)  # what the decode coordinator does on its way out
        return rests, seen, elapsed

    try:
        rests, seen, elapsed = asyncio.run(scenario())
    finally:
        aengine.shutdown()
    assert elapsed < 3.0  # at once, not at a request timeout
    for events, n in zip(rests, seen):
        last = events[-1]
        assert isinstance(last, ErrorEvent) and last.code == EngineStopped.code and last.type == "EngineStopped"
        assert last.completion_tokens == n  # what the client got, for metering
        assert "injected" not in last.message  # no internals to clients; the cause is logged
    assert seen[2] == seen[3] == 0  # the waiting one never ran, the receiving one never started
    assert not aengine.alive and isinstance(aengine.failure, RuntimeError)
    assert aengine.num_active() == 0
    assert engine.allocator.num_free == engine.allocator.num_pages  # running, waiting and held pages all returned


def test_steps_failing_again_and_again_stop_the_engine(model_dir: Path) -> None:
    engine = make(model_dir)
    aengine = AsyncEngine(engine)

    def device_lost(batch):
        raise RuntimeError("injected: device lost")

    engine.runner.run = device_lost  # type: ignore[method-assign]

    async def scenario() -> list[list[Event]]:
        ends = []
        while aengine.alive and len(ends) < 10:
            ends.append(await asyncio.wait_for(drain(aengine.submit(PROMPT, SamplingParams(max_tokens=4, **GREEDY))),
                                               timeout=5))
        return ends

    try:
        ends = asyncio.run(scenario())
    finally:
        aengine.shutdown()
    assert len(ends) == 3  # each failed step ended its own request; the third in a row stopped the engine
    assert [e[-1].code for e in ends] == [5000, 5000, EngineStopped.code]  # the third one stopped it
    assert not aengine.alive and engine.allocator.num_free == engine.allocator.num_pages


def test_one_failed_step_is_confined_to_its_requests(model_dir: Path) -> None:
    engine = make(model_dir)
    aengine = AsyncEngine(engine)
    real_postprocess = engine.postprocess
    calls = {"n": 0}

    def flaky(batch, logits):  # outside runner.run: sampling and bookkeeping
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected: postprocess bug")
        return real_postprocess(batch, logits)

    engine.postprocess = flaky  # type: ignore[method-assign]

    async def scenario() -> tuple[list[Event], list[Event]]:
        first = await drain(aengine.submit(PROMPT, SamplingParams(max_tokens=5, **GREEDY)))
        second = await drain(aengine.submit(PROMPT, SamplingParams(max_tokens=5, **GREEDY)))
        assert aengine.alive
        return first, second

    try:
        first, second = asyncio.run(asyncio.wait_for(scenario(), timeout=10))
    finally:
        aengine.shutdown()
    assert isinstance(first[-1], ErrorEvent) and first[-1].completion_tokens == streamed_tokens(first) == 1
    assert isinstance(second[-1], FinishEvent) and second[-1].completion_tokens == 5
    assert engine.allocator.num_free == engine.allocator.num_pages


def test_fail_all_ends_every_live_request_with_the_given_error_and_the_engine_serves_on(model_dir: Path) -> None:
    engine = make(model_dir, max_num_seqs=2)
    aengine = AsyncEngine(engine)

    async def scenario() -> tuple[int, list[list[Event]], list[Event]]:
        streams = [aengine.submit(PROMPT, SamplingParams(max_tokens=200, **GREEDY)) for _ in range(3)]
        firsts = [await anext(s) for s in streams[:2]]
        assert aengine.num_active() == 3
        n = aengine.fail_all(Draining("this worker is shutting down", retry_after_s=2))
        rests = await asyncio.wait_for(asyncio.gather(*(drain(s) for s in streams)), timeout=5)
        assert aengine.num_active() == 0
        ends = [[f, *r] for f, r in zip(firsts, rests)] + [rests[2]]
        await asyncio.to_thread(wait_all_free, engine)
        after = await asyncio.wait_for(drain(aengine.submit(PROMPT, SamplingParams(max_tokens=3, **GREEDY))), 10)
        assert aengine.alive
        return n, ends, after

    try:
        n, ends, after = asyncio.run(scenario())
    finally:
        aengine.shutdown()
    assert n == 3
    for events in ends:
        last = events[-1]
        assert isinstance(last, ErrorEvent) and last.code == Draining.code
        assert last.completion_tokens == streamed_tokens(events)
    assert isinstance(after[-1], FinishEvent) and after[-1].completion_tokens == 3
    assert engine.allocator.num_free == engine.allocator.num_pages


def test_a_group_failure_ends_every_request_while_the_engine_thread_waits_in_a_collective(model_dir: Path) -> None:
    """Rank 0 of a tensor-parallel group, its step waiting on a rank that died (a collective that raises only at the
    group's timeout; here a model run that blocks until released, then raises the group's error as the collective
    would): the watchdog marking the group failed ends every stream at once with the typed `GroupFailure`, the
    tokens each got metered, and new work is refused; when the step returns the engine thread stops, every page
    back. The group's collectives are never called: the model runs alone."""
    engine = make(model_dir, max_num_seqs=2)
    group = engine.group = Collectives(0, 2)
    aengine = AsyncEngine(engine)
    block, inside, release = threading.Event(), threading.Event(), threading.Event()
    run = engine.runner.run

    def waits_on_a_dead_rank(batch):
        if block.is_set():
            inside.set()
            release.wait(30)
            group.check()
        return run(batch)

    engine.runner.run = waits_on_a_dead_rank  # type: ignore[method-assign]
    long = SamplingParams(max_tokens=200, **GREEDY)

    async def scenario() -> tuple[list[Event], list[list[Event]], float]:
        streams = [aengine.submit(PROMPT, long, f"r{i}") for i in range(3)]  # two run, the third waits
        firsts = [await anext(s) for s in streams[:2]]
        block.set()
        assert await asyncio.to_thread(inside.wait, 10)
        started = time.monotonic()
        group.fail("rank 1 (pid 1) exited with code -9")  # what the group's watchdog does
        rests = await asyncio.wait_for(asyncio.gather(*(drain(s) for s in streams)), timeout=5)
        elapsed = time.monotonic() - started
        assert not aengine.alive
        with pytest.raises(EngineStopped):
            aengine.submit(PROMPT, long)
        release.set()
        await asyncio.to_thread(wait_all_free, engine)
        return firsts, rests, elapsed

    try:
        firsts, rests, elapsed = asyncio.run(scenario())
    finally:
        release.set()
        aengine.shutdown()
    assert elapsed < 3.0  # at once, not at the group's timeout
    for events in [[f, *r] for f, r in zip(firsts, rests)] + [rests[2]]:
        last = events[-1]
        assert isinstance(last, ErrorEvent) and last.code == GroupFailure.code and last.type == "GroupFailure", last
        assert last.completion_tokens == streamed_tokens(events)
    assert streamed_tokens(rests[2]) == 0
    assert isinstance(aengine.failure, GroupFailure) and aengine.num_active() == 0


# -- item 5: reservations, admissions and aborts racing the engine thread --------------------------------
def test_concurrent_reserve_release_add_abort_never_double_allocate(model_dir: Path) -> None:
    engine = make(model_dir, kv_cache_bytes=24 * PAGE_BYTES, max_num_seqs=8)
    alloc, sched = engine.allocator, engine.scheduler
    assert alloc.num_pages == 24
    params = SamplingParams(max_tokens=12, **GREEDY)  # 20 + 12 tokens: two pages per request
    need = sched.pages_for(20 + 12)
    problems: list[str] = []
    stop = threading.Event()

    def check_running() -> None:
        """Engine thread, between steps: every running request owns its pages alone, at the tags it holds."""
        seen: dict[int, str] = {}
        for s in sched.running:
            if len(s.page_ids) != need or alloc.tags_of(s.page_ids) != s.page_tags:
                problems.append(f"{s.request_id} runs on pages it does not own: {s.page_ids} {s.page_tags}")
            for p in s.page_ids:
                if p in seen or alloc.refcount(p) != 1:
                    problems.append(f"page {p} owned by {seen.get(p)} and {s.request_id}")
                seen[p] = s.request_id

    def engine_loop() -> None:
        while not stop.is_set() or engine.has_work():
            try:
                for out in engine.step():
                    if out.error is not None:
                        problems.append(f"{out.seq.request_id}: {out.error!r}")
                check_running()
            except Exception as exc:  # noqa: BLE001 - the test reports it
                problems.append(f"engine step raised {exc!r}")
                return
            time.sleep(0.0005)

    def client(k: int) -> None:
        rng = random.Random(k)
        for i in range(40):
            rid, prompt = f"c{k}-{i}", [rng.randrange(3, 300) for _ in range(20)]
            if rng.random() < 0.5:
                seq = engine.new_sequence(prompt, params, rid)
                if not engine.reserve(seq):
                    continue
                if alloc.tags_of(seq.page_ids) != seq.page_tags or any(alloc.refcount(p) != 1 for p in seq.page_ids):
                    problems.append(f"reservation {rid} got pages someone else holds")
                if rng.random() < 0.7:
                    engine.activate(seq, first_token=5)
                time.sleep(rng.random() * 0.002)
                engine.release_reserved(seq)  # the reader went away: a no-op once the engine took it
                time.sleep(0.003)  # a step or two: a released request must not run meanwhile
                engine.abort(rid)
            else:
                engine.add_request(prompt, params, rid)
                time.sleep(rng.random() * 0.004)
                if rng.random() < 0.5:
                    engine.abort(rid)

    with fast_thread_switching():
        stepper = threading.Thread(target=engine_loop)
        stepper.start()
        clients = [threading.Thread(target=client, args=(k,)) for k in range(4)]
        for t in clients:
            t.start()
        for t in clients:
            t.join()
        stop.set()
        stepper.join(timeout=60)
    assert not stepper.is_alive()
    assert problems == []
    assert alloc.num_free == alloc.num_pages and all(alloc.refcount(p) == 0 for p in range(alloc.num_pages))
    assert not sched.running and not sched.waiting


def test_a_reservation_released_before_the_engine_takes_its_activation_never_runs(model_dir: Path) -> None:
    engine = make(model_dir)
    seq = engine.new_sequence(PROMPT, SamplingParams(max_tokens=4, **GREEDY))
    assert engine.reserve(seq)
    engine.activate(seq, first_token=5)
    engine.release_reserved(seq)  # the decode reader left between activation and the next step
    assert engine.allocator.num_free == engine.allocator.num_pages
    outputs = engine.step()
    assert outputs == [] and not engine.scheduler.running and not engine.has_work()
    assert seq.finish_reason == "cancelled" and seq.output_ids == [5]


# -- item 3: snapshots read from other threads ----------------------------------------------------------
def test_snapshot_from_another_thread_while_the_prefix_cache_churns(model_dir: Path) -> None:
    engine = make(model_dir, kv_cache_bytes=64 * PAGE_BYTES, prefix_caching=True, max_num_seqs=16)
    errors: list[BaseException] = []
    reads = {"n": 0}
    stop = threading.Event()

    def reader() -> None:  # what the heartbeat, /stats and /metrics do, as often as it can
        while not stop.is_set():
            try:
                snap = engine.snapshot()
                assert snap["pages_free"] + snap["pages_used"] == snap["pages_total"]
                reads["n"] += 1
            except BaseException as exc:  # noqa: BLE001 - the test reports it
                errors.append(exc)

    rng = random.Random(0)
    prefixes = [[rng.randrange(3, 300) for _ in range(48)] for _ in range(12)]  # 3 blocks each
    params = SamplingParams(max_tokens=1, **GREEDY)
    with fast_thread_switching():
        t = threading.Thread(target=reader)
        t.start()
        try:
            for round_ in range(12):
                for i in rng.sample(range(len(prefixes)), 6):  # hits, inserts, LRU touches and evictions
                    engine.add_request(prefixes[i] + [round_ + 3] * 17, params, cache_salt="t")
                while engine.has_work():
                    engine.step()
        finally:
            stop.set()
            t.join()
    pool = engine.scheduler.prefix_cache
    assert pool.stats["evicted_blocks"] > 0 and pool.stats["hit_blocks"] > 0 and reads["n"] > 100
    assert errors == []
    snap = engine.snapshot()  # idle: what was published is exact
    assert snap["prefix_cache"]["blocks"] == len(pool) and snap["pages_evictable"] == pool.evictable()
    assert snap["prefix_cache"]["evicted_blocks"] == pool.stats["evicted_blocks"]


def test_an_idle_engine_republishes_after_held_pages_are_freed_off_its_thread(model_dir: Path) -> None:
    engine = make(model_dir, prefix_caching=True)
    aengine = AsyncEngine(engine)

    async def scenario() -> tuple[int, int, int]:
        await drain(aengine.submit(PROMPT, SamplingParams(max_tokens=1, **GREEDY), "p", cache_salt="t", hold=True))
        before = engine.snapshot()["pages_evictable"]  # the cached blocks are still read by the held request
        assert engine.release_held("p")  # the KV went out: the event loop frees the held pages
        deadline = time.monotonic() + 2
        while engine.snapshot()["pages_evictable"] == before and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return before, engine.snapshot()["pages_evictable"], len(engine.scheduler.prefix_cache)

    try:
        before, after, blocks = asyncio.run(scenario())
    finally:
        aengine.shutdown()
    assert (before, after) == (0, blocks) and blocks == 2  # 37 tokens: two full blocks cached


# -- item 4: fault (d), held pages freed and reused while the prefill server reads them -------------------
@pytest.mark.parametrize("when", ["before_the_read", "during_the_read"])
def test_held_pages_reused_under_the_kv_read_end_the_transfer_with_a_typed_error(model_dir: Path, when: str) -> None:
    pre = make(model_dir, kv_format="bf16")
    state: dict[str, object] = {}
    if when == "before_the_read":  # `_expire_held` ran between the prefill and the read of layer 1
        real_read_kv = pre.read_kv

        def read_kv(seq: Sequence, layer: int):
            if layer == 1 and "pages" not in state:
                state["pages"] = free_held_and_reallocate(pre, seq)
            return real_read_kv(seq, layer)

        pre.read_kv = read_kv  # type: ignore[method-assign]
    else:  # ... or while layer 1 was being copied out
        real_read_tokens = pre.cache.read_tokens

        def read_tokens(layer: int, slots):
            out = real_read_tokens(layer, slots)
            if layer == 1 and "pages" not in state:
                state["pages"] = free_held_and_reallocate(pre, next(iter(pre.scheduler.held.values())))
            return out

        pre.cache.read_tokens = read_tokens  # type: ignore[method-assign]

    with serve_in_thread(create_worker_app(AsyncEngine(pre), "tiny", role="prefill")) as url:
        body = msgspec.json.encode(PrefillRequest(PROMPT, SamplingParams(max_tokens=4, **GREEDY), "victim"))
        reader, frames = FrameReader(), []
        with httpx.stream("POST", f"{url}/v1/prefill", content=body, timeout=10) as resp:
            assert resp.status_code == 200
            for chunk in resp.iter_raw():
                frames += reader.feed(chunk)
    kinds = [type(h) for h, _ in frames]
    assert kinds == [KVBegin, KVLayer, KVError]  # layer 0 went out before the fault; nothing read after it
    err = frames[-1][0]
    assert err.code == KVIntegrityError.code and err.type == "KVIntegrityError"
    assert all(h.layer == 0 for h, _ in frames if isinstance(h, KVLayer))
    # the pages the fault handed to a new owner are that owner's; nothing else is left behind
    assert pre.allocator.num_free == pre.allocator.num_pages - len(state["pages"])  # type: ignore[arg-type]
    assert not pre.scheduler.held


# -- item 12 (part): the in-process KV-event list is bounded ------------------------------------------
def test_the_kv_event_list_is_bounded_and_counts_what_it_dropped(model_dir: Path) -> None:
    def churn(engine: LLMEngine) -> None:
        for t in range(10, 22):
            engine.add_request([t] * 40 + [1], SamplingParams(max_tokens=4, **GREEDY), cache_salt="t")
            while engine.has_work():
                engine.step()

    unbounded = make(model_dir, kv_cache_bytes=20 * PAGE_BYTES, prefix_caching=True)
    churn(unbounded)
    everything = list(unbounded.kv_events)
    assert unbounded.kv_events_dropped == 0 and len(everything) > 8
    bounded = make(model_dir, kv_cache_bytes=20 * PAGE_BYTES, prefix_caching=True, kv_events_max=5)
    churn(bounded)
    assert list(bounded.kv_events) == everything[-5:]  # the newest are kept, oldest dropped
    assert bounded.kv_events_dropped == len(everything) - 5
    bounded.kv_events.popleft()  # a publisher drains it as before
    assert len(bounded.kv_events) == 4
