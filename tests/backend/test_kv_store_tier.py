"""The KV store tier on a real mooncake_master: two engines (workers) share one store.

A prompt computed on worker A is served on worker B from the store (B computes only the
tail, greedy output identical); another tenant's salt misses; a corrupted object (checksum
or token ids) is rejected, removed and recomputed; a killed or hung master, or one never
reached, costs at most the bounded wait and the request succeeds; a put whose pages changed
hands is dropped; a request waiting for its fetch counts as waiting and, if its client leaves,
never runs; every page returns to the pool afterwards."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from backend.async_engine import AsyncEngine
from backend.engine import EngineConfig, LLMEngine
from backend.kv_store_client import MooncakeStoreClient
from backend.kv_store_codec import BlockRejected, decode_block, encode_block, read_pages
from backend.kv_store_keys import store_namespace
from backend.kv_store_tier import KVStoreTier, _PutJob
from backend.protocol import FinishEvent, TokenEvent
from backend.sampling_params import SamplingParams
from ops.cluster import MooncakeMaster

PAGE = 16
PROMPT_LEN = 100  # 6 full blocks; admission shares at most (100 - 1) // 16 = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.backend.tiny_models import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("store-tier") / "m", "llama", seed=11)


class Worker:
    """One engine with its own store client and tier, as one worker process would hold them."""

    def __init__(self, model_dir: Path, master: str, fetch_timeout_s: float = 5.0, connect: bool = True) -> None:
        self.engine = LLMEngine.from_pretrained(model_dir, EngineConfig(
            kv_cache_bytes=2**20, page_size=PAGE, max_model_len=256, prefix_caching=True))
        self.client = MooncakeStoreClient(master, segment_bytes=16 << 20, buffer_bytes=8 << 20)
        if connect:
            assert self.client.wait_ready(10), self.client.failure
        self.tier = KVStoreTier(self.client, store_namespace(self.engine, "tiny"), fetch_timeout_s=fetch_timeout_s,
                                retry_s=30.0).attach(self.engine)
        self.aengine = AsyncEngine(self.engine, self.tier)

    def generate(self, prompt: list[int], salt: str, max_tokens: int = 6) -> tuple[list[int], FinishEvent]:
        async def go() -> tuple[list[int], FinishEvent]:
            tokens: list[int] = []
            # ignore_eos: the prompts are random and the tiny model's greedy first token is sometimes EOS (id 2)
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            async for ev in self.aengine.submit(prompt, params, cache_salt=salt):
                if isinstance(ev, TokenEvent):
                    tokens += ev.token_ids
                else:
                    assert isinstance(ev, FinishEvent), ev
                    return tokens, ev
            raise AssertionError("no final event")
        out = asyncio.run(go())
        # idle again: every page not held by the prefix cache is back in the pool
        assert self.engine.allocator.num_used == len(self.engine.scheduler.prefix_cache)
        return out

    def mark(self) -> None:
        """Start counting: `delta` gives what happened after this (tests share workers)."""
        self._marked = {**self.tier.stats, "prompt_tokens": self.engine.stats["prompt_tokens"]}
        self.engine.kv_events.clear()

    def delta(self, name: str) -> int:
        now = self.engine.stats["prompt_tokens"] if name == "prompt_tokens" else self.tier.stats[name]
        return now - self._marked[name]

    def wait_puts(self, blocks: int) -> None:
        """Until `blocks` more blocks were put since `mark`."""
        deadline = time.monotonic() + 10
        while self.delta("put_blocks") < blocks and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.delta("put_blocks") == blocks, self.tier.stats

    def close(self) -> None:
        self.aengine.shutdown()
        cache = self.engine.scheduler.prefix_cache
        cache.clear()
        assert self.engine.allocator.num_free == self.engine.allocator.num_pages  # every page came back


@pytest.fixture(scope="module")
def shared(model_dir: Path, module_mooncake_master: MooncakeMaster) -> Iterator[tuple[Worker, Worker]]:
    """Workers A and B on one store, for the tests that do not break the master."""
    a, b = Worker(model_dir, module_mooncake_master.address), Worker(model_dir, module_mooncake_master.address)
    yield a, b
    a.close()
    b.close()


@pytest.fixture
def workers(shared: tuple[Worker, Worker]) -> tuple[Worker, Worker]:
    for w in shared:
        w.mark()
    return shared


def prompt() -> list[int]:
    return [random.randrange(3, 320) for _ in range(PROMPT_LEN)]


def test_a_prompt_computed_on_one_worker_is_served_on_another_from_the_store(workers: tuple[Worker, Worker]) -> None:
    a, b = workers
    p = prompt()
    tokens_a, fin_a = a.generate(p, "tenant-1")
    assert fin_a.cached_tokens == 0
    a.wait_puts(6)
    assert any(ev.tier == "store" and ev.kind == "stored" and len(ev.hashes) == 6 for ev in a.engine.kv_events)
    tokens_b, fin_b = b.generate(p, "tenant-1")
    assert tokens_b == tokens_a  # greedy: identical to recomputing the prompt
    assert fin_b.cached_tokens == 6 * PAGE
    assert b.delta("prompt_tokens") == PROMPT_LEN - 6 * PAGE  # only the tail was computed on B
    assert b.delta("imported_blocks") == 6 and b.delta("fetch_hit_blocks") == 6
    assert b.delta("put_blocks") == 0  # its blocks came from the store: nothing new to put
    events = [(ev.kind, ev.tier, len(ev.hashes)) for ev in b.engine.kv_events]
    assert ("stored", "local", 6) in events  # B holds them itself now
    assert ("stored", "store", 6) in events  # and the hit keeps the store's entries in the routers' index
    tokens_b2, fin_b2 = b.generate(p, "tenant-1")  # now a local hit: no second fetch
    assert tokens_b2 == tokens_a and fin_b2.cached_tokens == 6 * PAGE and b.delta("fetches") == 1


def test_another_tenants_salt_never_finds_the_blocks(workers: tuple[Worker, Worker]) -> None:
    a, b = workers
    p = prompt()
    tokens_a, _ = a.generate(p, "tenant-1")
    a.wait_puts(6)
    tokens_b, fin_b = b.generate(p, "tenant-2")
    assert tokens_b == tokens_a and fin_b.cached_tokens == 0
    assert b.delta("fetch_miss") == 1 and b.delta("imported_blocks") == 0
    assert b.delta("prompt_tokens") == PROMPT_LEN


@pytest.mark.parametrize("damage", ["checksum", "tokens"])
def test_a_corrupted_object_is_rejected_removed_and_recomputed(workers: tuple[Worker, Worker], damage: str) -> None:
    a, b = workers
    p = prompt()
    tokens_a, _ = a.generate(p, "tenant-1")
    a.wait_puts(6)
    from prefix_cache.hashing import block_hashes

    h = block_hashes(p, PAGE, "tenant-1")[2]
    key = a.tier.key(h)
    if damage == "checksum":
        obj = bytearray(a.client.get([key])[0])
        obj[len(obj) // 2] ^= 0x01
    else:  # a well-formed object (valid checksum) whose token ids are not the prompt's
        page = a.engine.scheduler.prefix_cache._entries[h].page
        obj = encode_block(a.tier.namespace, h, [7] * PAGE, a.tier.layout, read_pages(a.engine.cache, [page])[0])
    a.client.remove(key)
    a.client.put([key], [bytes(obj)])
    tokens_b, fin_b = b.generate(p, "tenant-1")
    assert tokens_b == tokens_a
    assert b.delta(f"rejected_{damage}") == 1
    assert fin_b.cached_tokens == 2 * PAGE and b.delta("imported_blocks") == 2  # blocks 0, 1; 2.. recomputed
    # the bad object was removed, and B's recomputed block put in its place (B's other recomputed blocks
    # were in the store already; under load an `exists` query can fail and B re-puts them: not asserted)
    deadline = time.monotonic() + 10
    while True:
        try:
            decode_block(a.client.get([key])[0], a.tier.namespace, h, p[2 * PAGE:3 * PAGE], a.tier.layout)
            break
        except BlockRejected:
            assert time.monotonic() < deadline, b.tier.stats
            time.sleep(0.02)
    # B's put thread counts the block after its put returns: the object can be readable a moment before
    while b.delta("put_blocks") < 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert b.delta("put_blocks") >= 1


def test_a_killed_master_costs_at_most_the_bound(model_dir: Path, mooncake_master: MooncakeMaster) -> None:
    w = Worker(model_dir, mooncake_master.address, fetch_timeout_s=0.2)
    try:
        w.mark()
        p = prompt()
        tokens, _ = w.generate(p, "t")
        w.wait_puts(6)
        w.engine.scheduler.prefix_cache.clear()  # (engine idle) a local miss, as on another worker
        mooncake_master.kill()
        tokens_again, fin = w.generate(p, "t")
        assert tokens_again == tokens and fin.cached_tokens == 0
        assert fin.ttft_s < 0.2 + 1.0, fin.ttft_s  # the bound, plus computing a 100-token prompt
        assert w.delta("fetch_errors") + w.delta("fetch_timeouts") == 1
        _, fin = w.generate(prompt(), "t")  # the store is skipped from now on, without waiting
        assert w.delta("skipped_down") == 1 and fin.cached_tokens == 0
    finally:
        w.close()


def test_a_hung_master_costs_at_most_the_bound(model_dir: Path, mooncake_master: MooncakeMaster) -> None:
    b = Worker(model_dir, mooncake_master.address, fetch_timeout_s=0.2)
    try:
        mooncake_master.pause()  # SIGSTOP: the master accepts connections and never answers
        t0 = time.monotonic()
        tokens, fin = b.generate(prompt(), "t")
        assert len(tokens) == 6 and fin.cached_tokens == 0
        assert time.monotonic() - t0 < 0.2 + 1.0 and fin.ttft_s < 0.2 + 1.0
        assert b.tier.stats["fetch_timeouts"] == 1
        b.generate(prompt(), "t")
        assert b.tier.stats["skipped_down"] == 1  # no answer at all: skipped for retry_s
    finally:
        mooncake_master.resume()
        b.close()


@pytest.mark.parametrize("where", ["black-holed", "hung"])
def test_a_master_never_reached_is_skipped(model_dir: Path, mooncake_master: MooncakeMaster, where: str) -> None:
    address = "192.0.2.1:50051" if where == "black-holed" else mooncake_master.address  # TEST-NET-1: no route
    if where == "hung":
        mooncake_master.pause()  # accepts connections, never answers: the client's setup fails
    b = Worker(model_dir, address, fetch_timeout_s=0.2, connect=False)
    try:
        assert b.client.wait_attempt(10) and not b.client.ready
        assert b.client.attempts == (1 if where == "hung" else 0)  # no TCP connection: setup is never tried
        t0 = time.monotonic()
        tokens, fin = b.generate(prompt(), "t")
        assert len(tokens) == 6 and time.monotonic() - t0 < 1.0
        assert b.tier.stats["skipped_not_ready"] == 1 and b.tier.stats["fetches"] == 0
    finally:
        mooncake_master.resume()
        b.close()


def test_a_put_of_pages_that_changed_hands_is_dropped(workers: tuple[Worker, Worker]) -> None:
    a, _ = workers
    p = prompt()
    a.generate(p, "tenant-1")
    a.wait_puts(6)
    from prefix_cache.hashing import block_hashes

    other = block_hashes(prompt(), PAGE, "tenant-1")[:2]
    pages = a.engine.allocator.allocate(2)
    stale = [t + 1 for t in a.engine.allocator.tags_of(pages)]  # as if the pages were reallocated since
    a.tier._put(_PutJob(other, [[1] * PAGE, [2] * PAGE], pages, stale))
    a.engine.allocator.release(pages)
    assert a.delta("put_dropped_changed_hands") == 2 and a.delta("put_blocks") == 6
    assert a.client.exists([a.tier.key(h) for h in other]) == [False, False]


def test_a_request_that_leaves_during_its_fetch_never_runs_and_pending_fetches_count_as_waiting(
        model_dir: Path, mooncake_master: MooncakeMaster) -> None:
    from backend.errors import CapacityError

    # Against the paused master the store call fails after Mooncake's own RPC timeout (~1 s) whatever the
    # fetch's bound, so the client leaves as soon as the fetch is in that call, not after a fixed sleep.
    w = Worker(model_dir, mooncake_master.address, fetch_timeout_s=1.0)
    w.engine.scheduler.config = dataclasses.replace(w.engine.scheduler.config, max_waiting=1)
    try:
        w.mark()
        mooncake_master.pause()  # the fetch waits its whole bound

        async def until(cond: Callable[[], bool], what: str, within_s: float = 5.0) -> None:
            deadline = time.monotonic() + within_s
            while True:
                await asyncio.sleep(0.01)  # first: lets the reader task start reading
                if cond():
                    return
                assert time.monotonic() < deadline, f"{what}: not within {within_s} s; {w.tier.stats}"

        async def go() -> None:
            t0 = time.monotonic()
            stream = w.aengine.submit(prompt(), SamplingParams(max_tokens=4), cache_salt="t")
            assert w.aengine.num_active() == 1
            with pytest.raises(CapacityError):  # the pending request holds the only waiting slot
                w.aengine.submit(prompt(), SamplingParams(max_tokens=4), cache_salt="t")
            reader = asyncio.create_task(anext(stream))
            await until(lambda: w.tier._current is not None or reader.done(), "the fetch reached the store")
            # it waits for the hung store (if not: what it got, and when)
            assert not reader.done(), (reader.result(), w.tier.stats, time.monotonic() - t0)
            assert w.aengine._pending, (w.tier.stats, time.monotonic() - t0)
            reader.cancel()  # the client leaves before its blocks arrive (the stream's reader is cancelled)
            with pytest.raises(asyncio.CancelledError):
                await reader
            await until(lambda: not w.aengine._pending, "the fetch ended")
            await asyncio.sleep(0.2)  # the engine thread would have queued it by now

        asyncio.run(go())
        assert w.aengine.num_active() == 0 and not w.aengine._pending
        assert w.delta("prompt_tokens") == 0 and not w.engine.scheduler.waiting  # never queued, never computed
        assert w.engine.allocator.num_used == 0
    finally:
        mooncake_master.resume()
        w.close()
