"""Time to first token of lone prompts of lengths the process has not seen: what the prefill's choices are worth.

One engine in process (default SmolLM2-135M, `--dtype auto`, `--kv-format auto`), lone prompts of
random token ids (no prefix cache hit), one output token each. Lengths: `--prompts` distinct random
lengths in [`--min-tokens`, `--max-tokens`), none a multiple of the granule. Every length runs each
arm once, the arms in a rotated order (the first mover changes from length to length), except
``exact_seen``, which runs right after ``exact`` by definition:

- ``default``: as a worker runs. A bfloat16 step's GEMM rows are rounded up to the granule
  (`backend/gemm_rows.py`; oneDNN builds a GEMM kernel per exact row count), and the C kernels of a
  step whose GEMMs run on torch's threads (RMSNorm, SwiGLU, RoPE, the KV store, the attention) share
  out their chunks on torch's OpenMP pool (`kernels/cpu_threads.py`'s `run_mode`). Before the timed
  lengths, one prompt per rounded size in the range runs, as in a server that has served a while;
- ``exact``: rows as they are (`EDGESERVE_GEMM_ROW_GRANULE=1`): the length is new, so every GEMM
  shape builds;
- ``exact_seen``: the same length again, rows as they are (all built): what no build costs, the
  bound the rounding can reach;
- ``helper_pool``: as ``default`` but the C kernels' chunks on the process's helper pool
  (`EDGESERVE_KERNEL_OPENMP=0`), whose threads sleep between calls;
- ``plain_weights``: as ``default`` but the GEMMs from the weights as they lie, not from their oneDNN
  packs (`backend/gemm_pack.py`: oneDNN then reorders each weight on every call).

TTFT = wall time of the steps that prefill the prompt and sample its token. Figures: the median
TTFT per arm, and per length the time of each other arm over ``default``'s (and ``exact`` over
``exact_seen``), each as the median over lengths with a 95% bootstrap interval (lengths resampled).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from typing import Any

from ops.bench.harness.engines import add_engine_arguments, in_process_engine
from ops.bench.harness.progress import log
from ops.bench.harness.prompts import random_ids
from ops.bench.harness.stats import median_ratio, rotated
from ops.bench.report import write_report

__all__ = ["add_arguments", "run", "lengths", "ARMS"]

_GRANULE, _OPENMP = "EDGESERVE_GEMM_ROW_GRANULE", "EDGESERVE_KERNEL_OPENMP"
ARMS = ("default", "exact", "exact_seen", "helper_pool", "plain_weights")
_RATIOS = (("exact", "default"), ("exact_seen", "default"), ("exact", "exact_seen"), ("helper_pool", "default"),
           ("plain_weights", "default"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p)
    p.add_argument("--prompts", type=int, default=None, help="distinct prompt lengths timed (default 60; quick 16)")
    p.add_argument("--min-tokens", type=int, default=130)
    p.add_argument("--max-tokens", type=int, default=600)
    p.add_argument("--granule", type=int, default=16, help="the GEMM row granule of the default arm")
    p.add_argument("--seed", type=int, default=0)


def lengths(count: int, low: int, high: int, granule: int, seed: int) -> list[int]:
    """`count` distinct random lengths in [low, high), none a multiple of `granule` (those need no rounding)."""
    pool = [n for n in range(low, high) if n % granule]
    if count > len(pool):
        raise ValueError(f"only {len(pool)} lengths in [{low}, {high}) are not multiples of {granule}")
    return random.Random(seed).sample(pool, count)


def _ttft_ms(engine: Any, n: int, rng: random.Random, granule: int, openmp: bool, packs: bool = True) -> float:
    """Milliseconds from adding a prompt of `n` fresh random ids to its first token, rows rounded to `granule`,
    the C kernels' chunks on torch's OpenMP pool or not, the GEMMs from the weights' oneDNN packs or not."""
    from backend import gemm_pack
    from backend.sampling_params import SamplingParams

    os.environ[_GRANULE], os.environ[_OPENMP] = str(granule), str(int(openmp))
    gemm_pack.use_packs = packs
    ids = random_ids(rng, n)
    start = time.perf_counter()
    engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while engine.has_work():
        engine.step()
    return (time.perf_counter() - start) * 1e3


def run(args: argparse.Namespace) -> int:
    import torch

    count = args.prompts or (16 if args.quick else 60)
    todo = lengths(count, args.min_tokens, args.max_tokens, args.granule, args.seed)
    engine, dtype, kv = in_process_engine(args, kv_cache_bytes=1 << 29, max_num_seqs=8)
    previous = {name: os.environ.get(name) for name in (_GRANULE, _OPENMP)}
    rng = random.Random(args.seed + 1)
    g = args.granule
    settings = {"default": (g, True, True), "exact": (1, True, True), "helper_pool": (g, False, True),
                "plain_weights": (g, True, False)}
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    try:
        sizes = range(args.min_tokens - args.min_tokens % g + g, args.max_tokens + g, g)
        log(f"prefill: {dtype}, kv {kv}, {torch.get_num_threads()} threads; building the {len(sizes)} rounded "
            f"sizes, then {count} new lengths x {len(ARMS)} arms")
        for n in sizes:
            _ttft_ms(engine, n, rng, g, True)
        for i, n in enumerate(todo):
            for arm in rotated(list(settings), i):
                times[arm].append(_ttft_ms(engine, n, rng, *settings[arm]))
                if arm == "exact":
                    times["exact_seen"].append(_ttft_ms(engine, n, rng, 1, True, True))
            if (i + 1) % 8 == 0:
                log(f"  {i + 1}/{count} lengths")
    finally:
        from backend import gemm_pack

        gemm_pack.use_packs = True
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    medians = {arm: statistics.median(v) for arm, v in times.items()}
    ratios = {f"{a}_over_{b}": median_ratio(times[a], times[b]) for a, b in _RATIOS}
    print(f"{'arm':<12} {'median TTFT ms':>15}")
    for arm in ARMS:
        print(f"{arm:<12} {medians[arm]:>15.1f}")
    for name, r in ratios.items():
        print(f"{name:<26} {r['median']:.3f}  [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]")
    write_report(args.json_path, {
        "model": args.model, "dtype": str(dtype).removeprefix("torch."), "kv_format": kv, "granule": g,
        "threads": torch.get_num_threads(), "lengths": todo, "ttft_ms": times, "median_ttft_ms": medians,
        "ratios": ratios, "headline": {name: r["median"] for name, r in ratios.items()}})
    return 0
