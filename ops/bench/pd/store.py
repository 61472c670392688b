"""`edgeserve bench pd`'s store phase: time to first token for a prefix another worker put in the KV
store, against recompute.

`store_ttft(model_dir, master)` runs two engines in this process, each with its own store
client on the Mooncake master at `master` (two workers of one cluster): worker A computes a
fresh random prompt of `prompt_tokens` tokens and puts its blocks; worker B, whose own pool
has never seen it, serves the same prompt (a **store hit**: B fetches the blocks and
computes only the last partial block) and a second fresh prompt of the same length that
is in no tier (a **store miss**: B asks the store, finds nothing, computes it all).
Each is a request with `max_tokens=1`, timed by the engine's own TTFT (arrival to first
token, the store wait included); `repeats` rounds, medians reported.
`edgeserve bench pd` reports these as `ttft_p50_s.store_hit` / `store_miss`, with the
Mooncake master it starts for the phase (`ops.cluster.mooncake_master`); target: a hit's
TTFT <= 0.5x a miss's.
"""

from __future__ import annotations

import asyncio
import random
import statistics
from pathlib import Path
from typing import NamedTuple

from backend.kv_store_tier import DEFAULT_FETCH_TIMEOUT_S

__all__ = ["StoreTTFT", "store_ttft", "print_store"]


class StoreTTFT(NamedTuple):
    store_hit_p50_s: float
    store_miss_p50_s: float
    hit_cached_tokens: int  # prompt tokens the hit took from the store (per request)
    block_bytes: int  # bytes of one block object's payload
    store_hit_s: list[float]
    store_miss_s: list[float]


def store_ttft(model_dir: Path, master: str, prompt_tokens: int = 1024, repeats: int = 3, *,
               kv_format: str = "fp32", page_size: int = 16, fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S,
               threads: int | None = None, seed: int = 0) -> StoreTTFT:
    """Median TTFT of store hits and misses for `prompt_tokens`-token prompts (see the module docstring)."""
    from backend.async_engine import AsyncEngine
    from backend.engine import EngineConfig, LLMEngine
    from backend.kv_store_client import MooncakeStoreClient
    from backend.kv_store_keys import store_namespace
    from backend.kv_store_tier import KVStoreTier
    from backend.protocol import FinishEvent
    from backend.sampling_params import SamplingParams

    rng = random.Random(seed)
    config = EngineConfig(kv_format=kv_format, page_size=page_size, max_model_len=prompt_tokens + 8,
                          kv_cache_bytes=4 * (prompt_tokens + page_size) * 64 * 2**10, gemm_buckets=(),
                          prefix_caching=True, num_threads=threads)
    workers = []
    for _ in range(2):
        engine = LLMEngine.from_pretrained(Path(model_dir), config)
        segment = max(256 << 20, 3 * (repeats + 1) * prompt_tokens * engine.cache.bytes_per_token)
        client = MooncakeStoreClient(master, segment_bytes=segment)
        if not client.wait_ready(30):
            raise TimeoutError(f"no connection to the Mooncake master at {master}: {client.failure}")
        tier = KVStoreTier(client, store_namespace(engine, str(model_dir)), fetch_timeout_s=fetch_timeout_s)
        workers.append((engine, tier.attach(engine), AsyncEngine(engine, tier)))
    vocab = workers[0][0].model.cfg.vocab_size

    def fresh() -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(prompt_tokens)]

    async def first_token(aengine: AsyncEngine, prompt: list[int]) -> FinishEvent:
        async for ev in aengine.submit(prompt, SamplingParams(max_tokens=1, temperature=0.0), cache_salt="bench"):
            if isinstance(ev, FinishEvent):
                return ev
        raise RuntimeError("the request ended without a finish event")

    (_, tier_a, a), (_, tier_b, b) = workers
    hits: list[float] = []
    misses: list[float] = []
    cached = 0
    try:
        asyncio.run(first_token(b, fresh()))  # warm-up (first forward passes are slower)
        tier_b.wait_puts(60)
        for _ in range(repeats):
            prompt = fresh()
            before = tier_a.stats["put_blocks"]
            asyncio.run(first_token(a, prompt))
            if not tier_a.wait_puts(60) or tier_a.stats["put_blocks"] - before < (prompt_tokens - 1) // page_size:
                raise TimeoutError(f"worker A's blocks were not put: {tier_a.snapshot()}")
            hit = asyncio.run(first_token(b, prompt))
            miss = asyncio.run(first_token(b, fresh()))
            tier_b.wait_puts(60)  # its puts of the missed prompt do not overlap the next round
            hits.append(hit.ttft_s)
            misses.append(miss.ttft_s)
            cached = hit.cached_tokens
    finally:
        for _, _, aengine in workers:
            aengine.shutdown()
    return StoreTTFT(statistics.median(hits), statistics.median(misses), cached, tier_b.layout.block_bytes, hits,
                     misses)


def print_store(r: dict) -> None:
    """The phase's table."""
    print(f"\n5) KV store tier: a {r['prompt_tokens']}-token prompt another worker put in the store vs one in no tier "
          f"(in process, two engines on one mooncake_master, {r['kv_format']} pools, {r['repeats']} rounds)")
    print(f"{'request':<12}{'TTFT p50 ms':>13}{'per round ms':>30}")
    for name, key in (("store hit", "store_hit_s"), ("store miss", "store_miss_s")):
        rounds = ",".join(f"{1e3 * v:.0f}" for v in r[key])
        print(f"{name:<12}{1e3 * r[key.replace('_s', '_p50_s')]:>13.0f}{rounds:>30}")
    print(f"hit took {r['hit_cached_tokens']} prompt tokens from the store; block object {r['block_bytes']} B")
