"""Bursts of requests that share a prompt prefix nobody has computed yet: waiting for it against computing it twice.

A tenant deploys a new system prompt, or a client fans one document out to several questions: k requests
with the same fresh prefix arrive together (or a few milliseconds apart), and none of its blocks is in the
prefix cache. One engine in process (default SmolLM2-135M, `--dtype auto`, `--kv-format auto`, the prefix
cache on); each request is the shared prefix (`--prefix-tokens`, random ids) plus `--own-tokens` of its own,
one output token. Two arms, every burst with a prefix of its own, the arms in a rotated order per round:

- ``wait`` (the scheduler's default): a waiting request whose next block a running prompt is still computing
  is admitted once that block is in the cache (`backend/scheduler.py`), so the prefix is computed once;
- ``side_by_side`` (`SchedulerConfig.wait_for_shared_prefix` False): every request is admitted as pages and
  the step's token budget allow and computes whatever is not cached yet when it is admitted.

Figures per workload (k requests, `--gap-ms` between arrivals): TTFT p50 and the burst's makespan (first
arrival to last first token), the prompt tokens the engine computed, and side_by_side / wait for the first
two as medians over rounds with a 95% bootstrap interval (rounds resampled).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
from typing import Any

from ops.bench.harness.engines import add_engine_arguments, in_process_engine
from ops.bench.harness.loops import open_loop
from ops.bench.harness.progress import log
from ops.bench.harness.prompts import random_ids
from ops.bench.harness.stats import median_ratio, rotated
from ops.bench.report import write_report

__all__ = ["add_arguments", "run", "ARMS"]

ARMS = ("wait", "side_by_side")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p)
    p.add_argument("--prefix-tokens", type=int, default=1024)
    p.add_argument("--own-tokens", type=int, default=32)
    p.add_argument("--bursts", default="2:0,4:0,8:0,4:50",
                   help="workloads, comma-separated k:gap_ms (k requests, gap_ms between arrivals)")
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 5; quick 2)")
    p.add_argument("--seed", type=int, default=0)


def _burst(engine: Any, k: int, gap_s: float, prefix: int, own: int, rng: random.Random) -> dict[str, Any]:
    """Add k requests sharing a fresh prefix, `gap_s` apart, step until each has its token; their TTFTs."""
    from backend.sampling_params import SamplingParams

    shared = random_ids(rng, prefix)
    prompts = [shared + random_ids(rng, own) for _ in range(k)]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    computed_before = engine.stats["prompt_tokens"]
    run = open_loop(engine, [i * gap_s for i in range(k)], lambda i: engine.add_request(prompts[i], params))
    times = [run.ttft(i) for i in range(k)]
    return {"ttft_s": times, "ttft_p50_s": statistics.median(times), "makespan_s": max(run.first) - run.start,
            "computed_tokens": engine.stats["prompt_tokens"] - computed_before,
            "cached_tokens": sum(s.num_cached_tokens for s in run.seqs)}


def run(args: argparse.Namespace) -> int:
    import torch

    rounds = args.rounds or (2 if args.quick else 5)
    workloads = [(int(k), float(g)) for k, g in (w.split(":") for w in args.bursts.split(","))]
    engine, dtype, kv = in_process_engine(args, kv_cache_bytes=1 << 29, max_num_seqs=16, prefix_caching=True)
    configs = {"wait": dataclasses.replace(engine.scheduler.config, wait_for_shared_prefix=True),
               "side_by_side": dataclasses.replace(engine.scheduler.config, wait_for_shared_prefix=False)}
    rng = random.Random(args.seed)
    log(f"prefix-burst: {dtype}, kv {kv}, {torch.get_num_threads()} threads, prefix {args.prefix_tokens} + "
        f"{args.own_tokens} own tokens; {len(workloads)} workloads x {len(ARMS)} arms x {rounds} rounds")
    for arm in ARMS:  # warm-up: every step size a burst makes, built once
        engine.scheduler.config = configs[arm]
        _burst(engine, 2, 0.0, args.prefix_tokens, args.own_tokens, rng)
    results: dict[str, dict[str, list[dict[str, Any]]]] = {f"{k}:{g:g}": {arm: [] for arm in ARMS}
                                                           for k, g in workloads}
    try:
        for r in range(rounds):
            for i, (k, gap) in enumerate(workloads):
                for arm in rotated(list(ARMS), r + i):
                    engine.scheduler.config = configs[arm]
                    results[f"{k}:{gap:g}"][arm].append(
                        _burst(engine, k, gap / 1e3, args.prefix_tokens, args.own_tokens, rng))
            log(f"  round {r + 1}/{rounds}")
    finally:
        engine.scheduler.config = configs["wait"]

    summary: dict[str, Any] = {}
    print(f"{'k:gap ms':<9} {'arm':<13} {'TTFT p50 ms':>12} {'makespan ms':>12} {'computed tok':>13}")
    for name, by_arm in results.items():
        row: dict[str, Any] = {}
        for arm in ARMS:
            runs = by_arm[arm]
            row[arm] = {"ttft_p50_ms": 1e3 * statistics.median(b["ttft_p50_s"] for b in runs),
                        "makespan_ms": 1e3 * statistics.median(b["makespan_s"] for b in runs),
                        "computed_tokens": statistics.median(b["computed_tokens"] for b in runs)}
            print(f"{name:<9} {arm:<13} {row[arm]['ttft_p50_ms']:>12.0f} {row[arm]['makespan_ms']:>12.0f} "
                  f"{row[arm]['computed_tokens']:>13.0f}")
        for key in ("ttft_p50_s", "makespan_s"):
            row[f"{key.removesuffix('_s')}_side_by_side_over_wait"] = median_ratio(
                [b[key] for b in by_arm["side_by_side"]], [b[key] for b in by_arm["wait"]])
        ttft, span = row["ttft_p50_side_by_side_over_wait"], row["makespan_side_by_side_over_wait"]
        print(f"{'':<9} side_by_side / wait: TTFT p50 {ttft['median']:.2f}x [{ttft['ci95'][0]:.2f}, "
              f"{ttft['ci95'][1]:.2f}], makespan {span['median']:.2f}x [{span['ci95'][0]:.2f}, {span['ci95'][1]:.2f}]")
        summary[name] = row
    write_report(args.json_path, {
        "model": args.model, "dtype": str(dtype).removeprefix("torch."), "kv_format": kv,
        "threads": torch.get_num_threads(), "prefix_tokens": args.prefix_tokens, "own_tokens": args.own_tokens,
        "rounds": rounds, "workloads": [f"{k}:{g:g}" for k, g in workloads], "summary": summary,
        "bursts": results,
        "headline": {f"ttft_p50_x.{name}": row["ttft_p50_side_by_side_over_wait"]["median"]
                     for name, row in summary.items()}
        | {f"makespan_x.{name}": row["makespan_side_by_side_over_wait"]["median"] for name, row in summary.items()}})
    return 0
