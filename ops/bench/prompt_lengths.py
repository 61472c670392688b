"""Time to first token of prompts whose lengths the process has not seen: GEMM rows rounded vs exact.

A bfloat16 engine's prefill GEMMs run through oneDNN, which builds a kernel for each exact row
count the first time it meets it (`backend/gemm_rows.py`); a server sees new prompt lengths all
day. One engine in process (default SmolLM2-135M, `--dtype auto`, `--kv-format auto`), lone
prompts of random token ids (no prefix cache hit), one output token. Lengths: `--prompts` distinct
random lengths in [`--min-tokens`, `--max-tokens`), none a multiple of the granule. Each length
runs three arms, the first two in an order that alternates by length:

- ``rounded``: rows rounded up to the granule (`EDGESERVE_GEMM_ROW_GRANULE`, default 16; what
  serving does). Before the timed lengths, one prompt per rounded size in the range is run, as a
  server that has served a while has built them;
- ``exact``: granule 1 (rows as they are): the length is new, so every GEMM shape builds;
- ``exact_seen``: granule 1 with the same length again (all built): what no build costs, the bound.

TTFT = wall time of the steps that prefill the prompt and sample its token. Figures: the median
TTFT per arm, and per length the ratios exact / rounded, exact / exact_seen and rounded /
exact_seen, each as the median over lengths with a 95% bootstrap interval.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from typing import Any

import numpy as np

from ops.bench.harness.progress import log
from ops.bench.harness.stats import block_bootstrap_ci
from ops.bench.report import write_report

__all__ = ["add_arguments", "run", "lengths", "ARMS"]

ARMS = ("rounded", "exact", "exact_seen")
_ENV = "EDGESERVE_GEMM_ROW_GRANULE"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--kv-format", default="auto", choices=["auto", "fp32", "bf16", "fp8_e4m3"])
    p.add_argument("--prompts", type=int, default=None, help="distinct prompt lengths timed (default 60; quick 16)")
    p.add_argument("--min-tokens", type=int, default=130)
    p.add_argument("--max-tokens", type=int, default=600)
    p.add_argument("--granule", type=int, default=16, help="the rounded arm's row granule")
    p.add_argument("--seed", type=int, default=0)


def lengths(count: int, low: int, high: int, granule: int, seed: int) -> list[int]:
    """`count` distinct random lengths in [low, high), none a multiple of `granule` (those need no rounding)."""
    pool = [n for n in range(low, high) if n % granule]
    if count > len(pool):
        raise ValueError(f"only {len(pool)} lengths in [{low}, {high}) are not multiples of {granule}")
    return random.Random(seed).sample(pool, count)


def _ttft_ms(engine: Any, n: int, rng: random.Random, granule: int) -> float:
    """Milliseconds from adding a prompt of `n` fresh random ids to its first token, rows rounded to `granule`."""
    from backend.sampling_params import SamplingParams

    os.environ[_ENV] = str(granule)
    ids = [rng.randrange(100, 40_000) for _ in range(n)]
    start = time.perf_counter()
    engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while engine.has_work():
        engine.step()
    return (time.perf_counter() - start) * 1e3


def _median_ratio(a: list[float], b: list[float]) -> dict[str, Any]:
    """Median over lengths of a[i] / b[i], with a 95% bootstrap interval (lengths resampled)."""
    ci = block_bootstrap_ci([(a, b)], lambda x, y: float(np.median(x / y)), block=1)
    return {"median": statistics.median(x / y for x, y in zip(a, b)), "ci95": list(ci)}


def run(args: argparse.Namespace) -> int:
    import torch

    from backend.cpu_features import resolve_dtype, resolve_kv_format
    from backend.engine import EngineConfig, LLMEngine
    from ops.pull import resolve_model

    count = args.prompts or (16 if args.quick else 60)
    todo = lengths(count, args.min_tokens, args.max_tokens, args.granule, args.seed)
    dtype = resolve_dtype(args.dtype)
    kv = resolve_kv_format(args.kv_format, dtype)
    engine = LLMEngine.from_pretrained(resolve_model(args.model), EngineConfig(
        dtype=dtype, kv_format=kv, kv_cache_bytes=1 << 29, max_num_seqs=8))
    previous = os.environ.get(_ENV)
    rng = random.Random(args.seed + 1)
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    try:
        g = args.granule
        sizes = range(args.min_tokens - args.min_tokens % g + g, args.max_tokens + g, g)
        log(f"prompt-lengths: {dtype}, kv {kv}, {torch.get_num_threads()} threads; building the {len(sizes)} "
            f"rounded sizes, then {count} new lengths x {len(ARMS)} arms")
        for n in sizes:
            _ttft_ms(engine, n, rng, g)
        for i, n in enumerate(todo):
            first = ("rounded", "exact") if i % 2 == 0 else ("exact", "rounded")
            for arm in first:
                times[arm].append(_ttft_ms(engine, n, rng, g if arm == "rounded" else 1))
            times["exact_seen"].append(_ttft_ms(engine, n, rng, 1))
            if (i + 1) % 8 == 0:
                log(f"  {i + 1}/{count} lengths")
    finally:
        if previous is None:
            os.environ.pop(_ENV, None)
        else:
            os.environ[_ENV] = previous

    medians = {arm: statistics.median(v) for arm, v in times.items()}
    ratios = {"exact_over_rounded": _median_ratio(times["exact"], times["rounded"]),
              "exact_over_exact_seen": _median_ratio(times["exact"], times["exact_seen"]),
              "rounded_over_exact_seen": _median_ratio(times["rounded"], times["exact_seen"])}
    print(f"{'arm':<12} {'median TTFT ms':>15}")
    for arm in ARMS:
        print(f"{arm:<12} {medians[arm]:>15.1f}")
    for name, r in ratios.items():
        print(f"{name:<24} {r['median']:.3f}  [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]")
    write_report(args.json_path, {
        "model": args.model, "dtype": str(dtype).removeprefix("torch."), "kv_format": kv, "granule": args.granule,
        "threads": torch.get_num_threads(), "lengths": todo, "ttft_ms": times, "median_ttft_ms": medians,
        "ratios": ratios, "headline": {name: r["median"] for name, r in ratios.items()}})
    return 0
