"""One tenant's flood and another tenant's few requests: admission shared between tenants against FIFO.

A worker serves many tenants; when one of them sends a burst far larger than the worker admits at once (a batch
job, a retry storm), the others' requests queue behind it in a first-come-first-served worker. One engine in
process (default SmolLM2-135M, `--dtype auto`, `--kv-format auto`, the engine's default limits: 64 running
sequences, 512 tokens a step): tenant ``flood`` adds `--flood` requests at once, tenant ``light`` one request
every `--light-gap-ms` from `--light-start-ms`, `--light` in all; every prompt random ids (`--prompt-tokens`),
`--output-tokens` greedy tokens each. Two arms, the order rotated per round:

- ``fair`` (the scheduler's default): first come first served within a tenant; between tenants the oldest
  request of the tenant with the fewest running sequences (`backend/scheduler.py`);
- ``fifo`` (`SchedulerConfig.fair_tenants` False): first come first served across tenants.

Figures per arm (medians over rounds): the light tenant's TTFT p50 and max, the flood's makespan (first arrival
to its last token) and the output tokens per second of the whole run; ratios fifo / fair for the light tenant's
TTFT p50 (what sharing buys it) and fair / fifo for the flood's makespan (what it costs the flood), each with a
95% bootstrap interval (rounds resampled).
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

ARMS = ("fair", "fifo")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p)
    p.add_argument("--flood", type=int, default=96, help="the flood tenant's requests, all at once")
    p.add_argument("--light", type=int, default=None, help="the light tenant's requests (default 8; quick 4)")
    p.add_argument("--light-start-ms", type=float, default=50.0)
    p.add_argument("--light-gap-ms", type=float, default=250.0)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 5; quick 2)")
    p.add_argument("--seed", type=int, default=0)


def _round(engine: Any, args: argparse.Namespace, light: int, rng: random.Random) -> dict[str, Any]:
    """The flood at once, then the light tenant's requests on their schedule; step until every request ends."""
    from backend.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    due = [0.0] * args.flood + [(args.light_start_ms + i * args.light_gap_ms) / 1e3 for i in range(light)]
    run = open_loop(engine, due, lambda i: engine.add_request(
        random_ids(rng, args.prompt_tokens), params, cache_salt="flood" if i < args.flood else "light"))
    flood, lights = range(args.flood), range(args.flood, args.flood + light)
    light_ttft = [run.ttft(i) for i in lights]
    total = max(run.ended) - run.start
    return {"light_ttft_s": light_ttft, "light_ttft_p50_s": statistics.median(light_ttft),
            "light_ttft_max_s": max(light_ttft), "flood_makespan_s": max(run.ended[i] for i in flood) - run.start,
            "flood_ttft_p50_s": statistics.median(run.first[i] - run.start for i in flood),
            "output_tok_s": (args.flood + light) * args.output_tokens / total, "total_s": total}


def run(args: argparse.Namespace) -> int:
    import torch

    rounds = args.rounds or (2 if args.quick else 5)
    light = args.light or (4 if args.quick else 8)
    engine, dtype, kv = in_process_engine(args)
    configs = {arm: dataclasses.replace(engine.scheduler.config, fair_tenants=arm == "fair") for arm in ARMS}
    rng = random.Random(args.seed)
    limits = engine.scheduler.config
    log(f"fairness: {dtype}, kv {kv}, {torch.get_num_threads()} threads, {limits.max_num_seqs} running at most, "
        f"{limits.max_num_batched_tokens} tokens a step; flood {args.flood} + light {light} requests of "
        f"{args.prompt_tokens} + {args.output_tokens} tokens; {len(ARMS)} arms x {rounds} rounds")
    warm = argparse.Namespace(**{**vars(args), "flood": 8})
    _round(engine, warm, 1, rng)
    results: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    try:
        for r in range(rounds):
            for arm in rotated(list(ARMS), r):
                engine.scheduler.config = configs[arm]
                results[arm].append(_round(engine, args, light, rng))
            log(f"  round {r + 1}/{rounds}")
    finally:
        engine.scheduler.config = configs["fair"]

    keys = ("light_ttft_p50_s", "light_ttft_max_s", "flood_ttft_p50_s", "flood_makespan_s", "output_tok_s")
    medians = {arm: {k: statistics.median(x[k] for x in results[arm]) for k in keys} for arm in ARMS}
    ratios = {"light_ttft_p50_fifo_over_fair": median_ratio([x["light_ttft_p50_s"] for x in results["fifo"]],
                                                             [x["light_ttft_p50_s"] for x in results["fair"]]),
              "flood_makespan_fair_over_fifo": median_ratio([x["flood_makespan_s"] for x in results["fair"]],
                                                             [x["flood_makespan_s"] for x in results["fifo"]]),
              "output_tok_s_fair_over_fifo": median_ratio([x["output_tok_s"] for x in results["fair"]],
                                                           [x["output_tok_s"] for x in results["fifo"]])}
    print(f"{'arm':<6} {'light TTFT p50 ms':>18} {'light TTFT max ms':>18} {'flood TTFT p50 ms':>18} "
          f"{'flood makespan s':>17} {'output tok/s':>13}")
    for arm in ARMS:
        m = medians[arm]
        print(f"{arm:<6} {1e3 * m['light_ttft_p50_s']:>18.0f} {1e3 * m['light_ttft_max_s']:>18.0f} "
              f"{1e3 * m['flood_ttft_p50_s']:>18.0f} {m['flood_makespan_s']:>17.2f} {m['output_tok_s']:>13.0f}")
    for name, r in ratios.items():
        print(f"{name:<32} {r['median']:.2f}x  [{r['ci95'][0]:.2f}, {r['ci95'][1]:.2f}]")
    write_report(args.json_path, {
        "model": args.model, "dtype": str(dtype).removeprefix("torch."), "kv_format": kv,
        "threads": torch.get_num_threads(), "max_num_seqs": limits.max_num_seqs,
        "max_num_batched_tokens": limits.max_num_batched_tokens,
        "workload": {"flood": args.flood, "light": light, "light_start_ms": args.light_start_ms,
                     "light_gap_ms": args.light_gap_ms, "prompt_tokens": args.prompt_tokens,
                     "output_tokens": args.output_tokens},
        "rounds": rounds, "results": results, "medians": medians, "ratios": ratios,
        "headline": {name: r["median"] for name, r in ratios.items()}})
    return 0
