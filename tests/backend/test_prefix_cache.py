"""The engine's prefix cache: shared pages, verified hits, LRU eviction, tenant salt, KV events in Redis."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from backend.engine import EngineConfig, LLMEngine
from backend.sampling_params import SamplingParams
from backend.sequence import SequenceStatus
from prefix_cache.hashing import block_hashes
from prefix_cache.kv_events import KVEventPublisher, PrefixIndex
from tests.backend.tiny_models import write_tiny_model

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("prefix") / "m", "llama", seed=3)


def make(model_dir: Path, caching: bool, kv_bytes: int = 2**20) -> LLMEngine:
    return LLMEngine.from_pretrained(model_dir, EngineConfig(kv_cache_bytes=kv_bytes, page_size=16, max_model_len=256,
                                                             prefix_caching=caching, gemm_buckets=()))


def run(engine: LLMEngine, prompt: list[int], salt: str = "t", params: SamplingParams = GREEDY) -> tuple[list[int], int]:
    seq = engine.add_request(prompt, params, cache_salt=salt)
    while engine.has_work():
        engine.step()
    return seq.output_ids, seq.num_cached_tokens


SYSTEM = [(7 * i) % 300 + 3 for i in range(53)]  # 3 full blocks and 5 tokens


def test_a_shared_prefix_is_computed_once_and_outputs_do_not_change(model_dir: Path) -> None:
    plain, cached = make(model_dir, False), make(model_dir, True)
    for tail in ([11, 12, 13], [40, 41], [99] * 9):
        expected, _ = run(plain, SYSTEM + tail)
        got, hits = run(cached, SYSTEM + tail)
        assert got == expected
    assert hits == 48  # the 3 full blocks of SYSTEM (the 4th block differs per tail)
    snap = cached.snapshot()["prefix_cache"]
    assert snap["hit_tokens"] == 96 and snap["blocks"] >= 3
    # cached blocks keep their pages (one reference each) after every request ended
    assert cached.allocator.num_free == cached.allocator.num_pages - snap["blocks"]


def test_hits_need_the_same_salt_and_the_same_tokens(model_dir: Path) -> None:
    engine = make(model_dir, True)
    run(engine, SYSTEM + [1], salt="tenant-a")
    assert run(engine, SYSTEM + [2], salt="tenant-b")[1] == 0  # another tenant shares nothing
    assert run(engine, SYSTEM + [2], salt="tenant-a")[1] == 48
    # a forged entry (a hash that maps to other tokens) is refused by the re-verification
    pool = engine.scheduler.prefix_cache
    other = [5] * 16
    h = block_hashes(other + [1], 16, "tenant-c")[0]
    some_page = next(iter(pool._entries.values())).page
    pool._entries[h] = type(next(iter(pool._entries.values())))(some_page, tuple(SYSTEM[:16]))
    engine.allocator.share([some_page])
    assert run(engine, other + [1], salt="tenant-c")[1] == 0


def test_the_whole_prompt_is_never_served_from_cache(model_dir: Path) -> None:
    engine = make(model_dir, True)
    prompt = SYSTEM[:48]  # exactly 3 blocks
    first, _ = run(engine, prompt)
    again, hits = run(engine, prompt)
    assert hits == 32 and again == first  # the last block is recomputed to get logits


def test_unreferenced_blocks_are_evicted_lru_when_pages_run_short(model_dir: Path) -> None:
    engine = make(model_dir, True, kv_bytes=20 * 16 * 2 * 3 * 2 * 16 * 4)  # 20 pages of the tiny model
    assert engine.allocator.num_pages == 20
    prompts = [[t] * 40 + [1] for t in range(10, 20)]  # 2 cached blocks each, 4 pages per request
    for p in prompts:
        run(engine, p, params=SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    pool = engine.scheduler.prefix_cache
    assert pool.stats["evicted_blocks"] > 0 and len(pool) * 1 + engine.allocator.num_free == 20
    # the most recent prompt's blocks survived; the oldest were evicted first
    assert run(engine, prompts[-1])[1] == 32 and run(engine, prompts[0])[1] == 0


def test_kv_events_make_the_redis_index_exact(model_dir: Path, redis_url: str) -> None:
    engine = make(model_dir, True, kv_bytes=20 * 16 * 2 * 3 * 2 * 16 * 4)

    async def go() -> None:
        pub = KVEventPublisher(redis_url, "tiny", "w1", engine.kv_events)
        index = PrefixIndex(aioredis.Redis.from_url(redis_url))
        task = asyncio.create_task(pub.run())
        hashes = block_hashes(SYSTEM + [1], 16, "t")
        run(engine, SYSTEM + [1])
        await asyncio.sleep(0.1)
        assert await index.overlap("tiny", hashes) == {"w1": 3}
        assert await index.overlap("tiny", block_hashes(SYSTEM + [1], 16, "other")) == {}
        for t in range(20, 30):  # push SYSTEM's blocks out of the 20-page pool
            run(engine, [t] * 40 + [1], params=SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        await asyncio.sleep(0.1)
        assert await index.overlap("tiny", hashes) == {}
        held = block_hashes([29] * 40 + [1], 16, "t")
        assert await index.overlap("tiny", held) == {"w1": 2}
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert await index.overlap("tiny", held) == {}  # a stopped worker withdraws what it published
        await index.redis.aclose()

    asyncio.run(go())


# -- a shared prefix still being computed ----------------------------------------------------------------------------

LONG = [(11 * i) % 290 + 5 for i in range(100)]  # 6 full blocks and 4 tokens


def make_chunked(model_dir: Path, caching: bool = True, chunk: int = 16, budget: int = 64) -> LLMEngine:
    return LLMEngine.from_pretrained(model_dir, EngineConfig(
        kv_cache_bytes=2**20, page_size=16, max_model_len=256, prefix_caching=caching, gemm_buckets=(),
        prefill_chunk_size=chunk, max_num_batched_tokens=budget))


def drain(engine: LLMEngine) -> None:
    while engine.has_work():
        engine.step()


def test_blocks_enter_the_cache_as_the_prompts_chunks_complete(model_dir: Path) -> None:
    engine = make_chunked(model_dir, chunk=16, budget=40)
    engine.add_request(LONG + [1], GREEDY, cache_salt="t")
    engine.add_request([9] * 20, GREEDY, cache_salt="t")  # not alone: the long prompt runs in 16-token chunks
    pool = engine.scheduler.prefix_cache
    engine.step()
    assert len(pool) == 1 + 1  # a 16-token chunk of each: their first blocks, before either prompt is done
    engine.step()
    assert len(pool) == 2 + 1  # the long prompt's next (the short one's 4 last tokens fill no block)
    drain(engine)
    assert len(pool) == 6 + 1


def test_a_prefix_in_flight_is_waited_for_not_computed_twice(model_dir: Path) -> None:
    expected = {tail: run(make(model_dir, False), LONG + [tail])[0] for tail in (1, 2)}
    engine = make_chunked(model_dir)
    first = engine.add_request(LONG + [1], GREEDY, cache_salt="t")
    second = engine.add_request(LONG + [2], GREEDY, cache_salt="t")  # the same 6 blocks, arriving together
    other = engine.add_request([7] * 30, GREEDY, cache_salt="t")  # behind it, sharing nothing
    engine.step()
    assert first.num_computed_tokens == 16  # its first chunk (not alone: others wait)
    assert second.status is SequenceStatus.WAITING  # passed over: its first block is being computed
    assert other.status is SequenceStatus.RUNNING  # the request behind it was not held up
    seen = []  # `first`'s computed tokens at each step's admission while `second` waits, then at its own
    while second.status is SequenceStatus.WAITING:
        seen.append(first.num_computed_tokens)
        engine.step()
    assert all(n < 96 for n in seen[:-1]) and seen[-1] >= 96  # waits exactly until the 6 shared blocks are in
    assert second.num_cached_tokens == 96  # then starts from all 6: they were computed once
    drain(engine)
    assert first.output_ids == expected[1] and second.output_ids == expected[2]
    assert engine.allocator.num_free == engine.allocator.num_pages - len(engine.scheduler.prefix_cache)


def test_a_prompt_only_others_wait_on_takes_the_whole_budget(model_dir: Path) -> None:
    engine = make_chunked(model_dir, chunk=16, budget=64)
    first = engine.add_request(LONG + [1], GREEDY, cache_salt="t")
    second = engine.add_request(LONG + [2], GREEDY, cache_salt="t")
    engine.step()
    assert first.num_computed_tokens == 16 and second.status is SequenceStatus.WAITING
    engine.step()  # `second` waits for its blocks either way: `first` counts as alone
    assert first.num_computed_tokens == 16 + 64
    drain(engine)
    assert second.num_cached_tokens == 96


def test_no_wait_across_tenants_for_scoring_or_without_the_cache(model_dir: Path) -> None:
    for caching, salt, params in ((True, "u", GREEDY),  # another tenant's hashes differ: nothing to wait for
                                  (True, "t", SamplingParams(max_tokens=1, prompt_logprobs=0)),  # scoring computes all
                                  (False, "t", GREEDY)):
        engine = make_chunked(model_dir, caching=caching)
        engine.add_request(LONG + [1], GREEDY, cache_salt="t")
        second = engine.add_request(LONG + [2], params, cache_salt=salt)
        engine.step()
        assert second.status is SequenceStatus.RUNNING and second.num_computed_tokens == 16
        drain(engine)
        assert second.num_cached_tokens == 0


def test_an_aborted_prompt_leaves_its_computed_blocks_to_the_one_waiting(model_dir: Path) -> None:
    expected = run(make(model_dir, False), LONG + [2])[0]
    engine = make_chunked(model_dir)
    first = engine.add_request(LONG + [1], GREEDY, cache_salt="t")
    second = engine.add_request(LONG + [2], GREEDY, cache_salt="t")
    engine.step()
    engine.step()
    assert second.status is SequenceStatus.WAITING and first.is_prefilling
    done = first.num_computed_tokens // 16
    engine.abort(first.request_id)
    engine.step()
    assert second.status is SequenceStatus.RUNNING  # nothing in flight to wait for any more
    drain(engine)
    assert second.num_cached_tokens == 16 * done and second.output_ids == expected
    assert engine.allocator.num_free == engine.allocator.num_pages - len(engine.scheduler.prefix_cache)
