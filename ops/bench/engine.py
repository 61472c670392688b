"""Engine throughput and latency vs `transformers` generate (one at a time and static batches).

Every system gets the same requests: chat-templated prompts of varied length and
fixed per-request output lengths (EOS ignored), greedy. Each concurrency level c
has its own workload W_c (2c requests, at least 6; ``--quick``: c, at least 3), and
every system runs on it:

- ``edgeserve``: our engine in-process, closed loop at concurrency c (a new
  request is submitted as soon as one finishes), continuous batching.
- ``hf_sequential``: `transformers` `generate` on W_c one request at a time, so
  "vs one at a time" at c > 1 compares the same requests, not another workload.
- ``hf_batched`` (c > 1): `generate` on static batches of c left-padded requests of
  W_c; a batch runs until its longest request is done and only requested tokens count.

Interleaving: R rounds (3; quick 2). In each round every level runs every system
once, the systems' order rotated (`schedule`: a Latin rotation, level i of round r
starts at system r + i), so a slow spell of this shared machine lands on all of
them rather than on whichever ran last. Ratios (edgeserve tok/s / the other's) are
taken within a round, on the same requests, and reported as the median over rounds
with their [min, max] and every round's value in the JSON; the table's figures pool
every round's requests.

TTFT = first token time - submit time; TPOT = (last - first) / (tokens - 1),
per request. The machine's bounds are measured in the same run: read bandwidth
(a large tensor reduction) and the GEMM rate (the fastest of 5 2048^3 GEMMs, in the compute
dtype or float32, whichever is faster: bfloat16 weights run float32 GEMMs where that pays),
giving %-of-bound = throughput / (bandwidth / weight bytes per token) at c=1 and
throughput / (GEMM rate / 2 * params FLOPs per token) at the top level; the last counts
output tokens only (the target's figure), ``pct_of_bound_all_tokens`` prompt tokens too, each at its layers'
FLOPs (no LM head: only the rows that sample are scored): how busy the GEMMs were.

The GEMM figure depends on the workload's prompt tokens per output token: an engine whose every token ran at
the GEMM rate would read 100 / (1 + prompt tokens per output token x the layers' share) percent on output
tokens (`gemm_ceiling_pct`). The quick levels' 16-32-token answers to ~80-token prompts put that ceiling at
~27%, under the 35% target whatever the engine does. So the quick run takes the GEMM figure from the full
run's requests at the top level (`gemm_workload`: the same 2c requests of 64-128 output tokens, ceiling ~60%),
edgeserve only, once per round after the round's levels (~10-20 s each); the full run's top level is that
workload already. The report's ``gemm_workload`` says which requests the figure came from.
End to end: unless ``--no-llamacpp``, the run ends with `edgeserve bench e2e` (edgeserve
as `edgeserve up` against llama.cpp's `llama-server` through each OpenAI chat endpoint, per
format class: fp32, bf16, int4; see `ops/bench/e2e.py`), once the in-process engine is
freed; the report gains ``end_to_end`` and ``ratio_vs_llamacpp`` (format -> c -> edgeserve
tok/s over llama.cpp's).

`transformers` runs in the faster of the compute dtype and float32 on this host (``--hf-dtype auto``,
`ops.bench.engine_systems.pick_hf_dtype`, where the systems' loops live).

Targets (the issue's, this CPU): c=1 >= 1.5x and c=32 >= 10x `transformers` one at
a time, c=32 >= 1.5x its static batches, c=32 at >= 35% of the GEMM bound.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import asdict

import torch

from ops.bench.engine_systems import Timings, bench_hf, bench_ours, pick_hf_dtype
from ops.bench.harness.machine import measure_machine
from ops.bench.harness.progress import log
from ops.bench.harness.prompts import TOPICS
from ops.bench.harness.stats import rotated, spread
from ops.bench.report import write_report

__all__ = ["add_arguments", "run", "schedule", "systems_at", "ratios", "engine_targets", "pct_all_tokens"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="compute dtype for every system (auto: what `serve` picks on this host, "
                        "backend/cpu_features.py)")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample every in-process request at this temperature (default 0: greedy, the targets' "
                        "setting; the end-to-end part stays greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="with --temperature: every request's top_p (1: off)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--skip-hf", action="store_true", help="measure only our engine")
    p.add_argument("--hf-dtype", default="auto", choices=["auto", "same", "float32", "bfloat16"],
                   help="transformers' dtype (auto: the faster of the compute dtype and float32 on this host, "
                        "timed at start; same: the compute dtype)")
    p.add_argument("--rounds", type=int, default=None, help="rounds of every system on every level (default 3; "
                   "quick 2), the order of the systems rotated each round")
    from ops.bench import e2e

    e2e.add_arguments(p)  # then end to end against llama.cpp's server (`bench e2e`), unless --no-llamacpp


FULL_OUTPUT_TOKENS = (64, 128)  # a full run's requests: output tokens, shortest and longest
FULL_WAVES = 2  # a full run's level c runs 2c requests


def _make_workload(tokenizer, n: int, out_lo: int, out_hi: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        extra = " Please be detailed and give examples." * rng.randint(0, 12)
        msg = [{"role": "user", "content": f"Write a short essay about {topic}.{extra}"}]
        ids = tokenizer.encode(tokenizer.apply_chat_template(msg, add_generation_prompt=True))
        reqs.append((ids, rng.randint(out_lo, out_hi)))
    return reqs


def systems_at(c: int, with_hf: bool) -> list[str]:
    """The systems run on concurrency level c's workload (hf_batched only where a batch has > 1 request)."""
    return ["edgeserve", *(["hf_sequential"] if with_hf else []), *(["hf_batched"] if with_hf and c > 1 else [])]


def schedule(levels: list[int], rounds: int, with_hf: bool) -> list[tuple[int, int, str]]:
    """(round, level, system) in run order: round by round, level by level, the systems in a Latin
    rotation (level i of round r starts at system r + i): over as many rounds as systems, each
    runs first, middle and last on every level once."""
    return [(r, c, system) for r in range(rounds) for i, c in enumerate(levels)
            for system in rotated(systems_at(c, with_hf), r + i)]


def ratios(by_round: dict[tuple[str, int, int], Timings], levels: list[int], rounds: int,
           baseline: str) -> dict[str, dict[str, object]]:
    """Per level, edgeserve's tok/s over `baseline`'s on the same requests in the same round: the
    median over rounds, their spread and every round's value (levels where the baseline ran)."""
    out: dict[str, dict[str, object]] = {}
    for c in levels:
        per = [by_round[("edgeserve", c, r)].tokens / by_round[("edgeserve", c, r)].wall_s
               / (by_round[(baseline, c, r)].tokens / by_round[(baseline, c, r)].wall_s)
               for r in range(rounds) if (baseline, c, r) in by_round]
        if per:
            out[str(c)] = spread(per) | {"per_round": per}
    return out


def pct_all_tokens(pct_output: float, workload: list[tuple[list[int], int]], layer_share: float) -> float:
    """Every token the model ran (prompt and output) against the GEMM bound, from `pct_output` (output tokens
    only, each at the whole model's FLOPs): how busy the GEMMs were. A prompt token runs the layers only,
    `layer_share` of an output token's FLOPs (the LM head scores just the rows that sample)."""
    prompt_per_output = sum(len(ids) for ids, _ in workload) / sum(n for _, n in workload)
    return pct_output * (1 + prompt_per_output * layer_share)


def gemm_ceiling_pct(workload: list[tuple[list[int], int]], layer_share: float) -> float:
    """The output-token GEMM figure (percent of the bound) of an engine whose every token, prompt and output,
    ran at the GEMM rate: what `pct_all_tokens` reads as 100 on this workload."""
    return 100.0 * 100.0 / pct_all_tokens(100.0, workload, layer_share)


def workload_shape(quick: bool) -> tuple[tuple[int, int], int]:
    """((shortest, longest) output tokens of a request, waves of c requests per level) for a run."""
    return ((16, 32), 1) if quick else (FULL_OUTPUT_TOKENS, FULL_WAVES)


def gemm_workload(tokenizer, top: int) -> list[tuple[list[int], int]]:
    """The full run's requests at its top level c = `top`, which the GEMM figure is judged on in every run."""
    return _make_workload(tokenizer, max(top * FULL_WAVES, 6), *FULL_OUTPUT_TOKENS, seed=top)


def engine_targets(seq: dict[str, dict], bat: dict[str, dict], pct: dict[str, float]) -> dict[str, bool]:
    """The issue's targets on the medians over rounds (those whose level did not run are left out)."""
    out = {}
    if "1" in seq:
        out["c1_ge_1.5x_hf_sequential"] = seq["1"]["median"] >= 1.5
    if "32" in seq:
        out["c32_ge_10x_hf_sequential"] = seq["32"]["median"] >= 10.0
    if "32" in bat:
        out["c32_ge_1.5x_hf_batched"] = bat["32"]["median"] >= 1.5
    if "32" in pct:
        out["c32_ge_35pct_of_gemm_bound"] = pct["32"] >= 35.0
    return out


def run(args: argparse.Namespace) -> int:
    from backend.cpu_features import resolve_dtype
    from backend.engine import DTYPES, EngineConfig, LLMEngine
    from backend.tokenizer import Tokenizer
    from ops.pull import resolve_model

    if args.threads:
        torch.set_num_threads(args.threads)
    args.dtype = resolve_dtype(args.dtype)
    dtype = DTYPES[args.dtype]
    model_dir = resolve_model(args.model)
    tok = Tokenizer.from_model_dir(model_dir)
    levels = [int(c) for c in args.concurrency.split(",")]
    (out_lo, out_hi), waves = workload_shape(args.quick)
    rounds = args.rounds or (2 if args.quick else 3)
    started = time.perf_counter()

    machine = measure_machine(dtype)
    log(f"machine: read {machine['read_gb_s']:.1f} GB/s, GEMM bound {machine['bound_gemm_gflop_s']:.0f} GFLOP/s "
        f"({args.dtype} {machine['gemm_gflop_s']:.0f}, float32 {machine['float32_gemm_gflop_s']:.0f})")
    engine = LLMEngine.from_pretrained(model_dir, EngineConfig(dtype=args.dtype, kv_format="bf16"
                                                               if args.dtype == "bfloat16" else "fp32",
                                                               kv_cache_bytes=1 << 30, max_num_seqs=max(levels)))
    weight_bytes = engine.model.weight_bytes
    params = weight_bytes // dtype.itemsize
    layer_share = 1 - engine.model.lm_head.nbytes / weight_bytes  # of a token's GEMM work, without the LM head
    workloads = {c: _make_workload(tok, max(c * waves, 3 if args.quick else 6), out_lo, out_hi, seed=c)
                 for c in levels}
    warm = _make_workload(tok, 2, 4, 4, seed=99)
    bench_ours(engine, warm, 2)
    hf, pad, hf_dtype = None, 0, None
    if not args.skip_hf:
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        hf, hf_dtype = pick_hf_dtype(hf, dtype, args.hf_dtype)
        pad = tok.eos_token_ids and min(tok.eos_token_ids) or 0
        bench_hf(hf, warm[:1], 1, pad)
    by_round: dict[tuple[str, int, int], Timings] = {}
    top = max(levels)
    extra = gemm_workload(tok, top) if args.quick and top > 1 else None  # the GEMM figure's own requests
    extra_t = Timings()
    order = schedule(levels, rounds, hf is not None)
    for i, (r, c, system) in enumerate(order):
        t = (bench_ours(engine, workloads[c], c, args.temperature, args.top_p) if system == "edgeserve"
             else bench_hf(hf, workloads[c], 1 if system == "hf_sequential" else c, pad, args.temperature, args.top_p))
        by_round[(system, c, r)] = t
        log(f"round {r} c={c:<3} {system:<14} {len(workloads[c])} requests: {t.tokens / t.wall_s:7.1f} tok/s, "
            f"{t.wall_s:.1f} s")
        if extra is not None and (i + 1 == len(order) or order[i + 1][0] != r):  # the round's last run
            extra_t += (t := bench_ours(engine, extra, top, args.temperature, args.top_p))
            log(f"round {r} the full run's c={top} requests (GEMM figure) edgeserve {len(extra)} requests: "
                f"{t.tokens / t.wall_s:7.1f} tok/s, {t.wall_s:.1f} s")
    del engine, hf

    pooled = {}
    for (system, c, _), t in by_round.items():
        pooled[(system, c)] = pooled.get((system, c), Timings()) + t
    results = [t.result(system, 1 if system == "hf_sequential" else c, c) for (system, c), t in pooled.items()]
    per_round = [t.result(system, 1 if system == "hf_sequential" else c, c, r)
                 for (system, c, r), t in by_round.items()]
    ratio_seq = ratios(by_round, levels, rounds, "hf_sequential")
    ratio_bat = ratios(by_round, levels, rounds, "hf_batched")
    ours = {c: pooled[("edgeserve", c)].tokens / pooled[("edgeserve", c)].wall_s for c in levels}
    bound_c1 = machine["read_gb_s"] * 1e9 / weight_bytes  # tok/s if every step streams the weights once
    bound_gemm = machine["bound_gemm_gflop_s"] * 1e9 / (2 * params)  # tok/s if every step ran at the GEMM rate
    pct, pct_all = {}, {}
    if 1 in ours:
        pct["1"] = 100 * ours[1] / bound_c1
    gemm_load, gemm_tok_s = (extra, extra_t.tokens / extra_t.wall_s) if extra is not None else (workloads[top],
                                                                                               ours[top])
    if top > 1:
        pct[str(top)] = 100 * gemm_tok_s / bound_gemm
        pct_all[str(top)] = pct_all_tokens(pct[str(top)], gemm_load, layer_share)
    ceiling = gemm_ceiling_pct(gemm_load, layer_share)
    targets = engine_targets(ratio_seq, ratio_bat, pct)
    total_s = time.perf_counter() - started
    _print(args, machine, weight_bytes, bound_c1, bound_gemm, results, ratio_seq, ratio_bat, pct, pct_all, ceiling,
           targets, rounds, total_s, hf_dtype)

    report = {
        "model": args.model, "dtype": args.dtype, "temperature": args.temperature, "top_p": args.top_p,
        "hf_dtype": hf_dtype, "threads": torch.get_num_threads(),
        "quick": args.quick,
        "rounds": rounds, "machine": machine, "weight_bytes": weight_bytes,
        "workload": {str(c): {"requests": len(w), "prompt_tokens": sum(len(i) for i, _ in w),
                              "output_tokens": sum(n for _, n in w)} for c, w in workloads.items()},
        "order": [list(x) for x in order],
        "gemm_workload": None if top == 1 else {
            "concurrency": top, "requests": len(gemm_load), "prompt_tokens": sum(len(i) for i, _ in gemm_load),
            "output_tokens": sum(n for _, n in gemm_load), "ceiling_pct": ceiling, "edgeserve_tok_s": gemm_tok_s,
            "source": "the full run's top-level requests" if args.quick else f"the c={top} level"},
        "headline": {**{f"c{c}_vs_hf_sequential": v["median"] for c, v in ratio_seq.items()},
                     **{f"c{c}_vs_hf_batched": v["median"] for c, v in ratio_bat.items()},
                     **{f"c{c}_pct_of_bound": v for c, v in pct.items()},
                     **{f"c{c}_pct_of_bound_all_tokens": v for c, v in pct_all.items()}},
        "results": [asdict(r) for r in results], "results_per_round": [asdict(r) for r in per_round],
        "ratio_vs_hf_sequential": {c: v["median"] for c, v in ratio_seq.items()},
        "ratio_vs_hf_batched": {c: v["median"] for c, v in ratio_bat.items()},
        "ratio_spread": {"hf_sequential": ratio_seq, "hf_batched": ratio_bat},
        "pct_of_bound": pct, "pct_of_bound_all_tokens": pct_all, "targets": targets, "total_s": total_s,
    }
    if not args.no_llamacpp:  # end to end through each OpenAI endpoint (`bench e2e`), after the engine is freed
        from ops.bench.e2e import end_to_end

        report["end_to_end"] = end_to_end(args)
        report["ratio_vs_llamacpp"] = report["end_to_end"]["ratio_vs_llamacpp"]
    write_report(args.json_path, report)
    return 0


def _print(args, machine, weight_bytes, bound_c1, bound_gemm, results, ratio_seq, ratio_bat, pct, pct_all, ceiling,
           targets, rounds, total_s, hf_dtype) -> None:
    fmt = lambda v: f"{v['median']:.2f}x [{v['min']:.2f}, {v['max']:.2f}]"  # noqa: E731
    print(f"\nedgeserve bench engine  model={args.model} dtype={args.dtype}"
          f"{' transformers=' + hf_dtype['dtype'] if hf_dtype else ''} threads={torch.get_num_threads()}"
          f"{' (quick)' if args.quick else ''}; {rounds} rounds, systems in rotated order, pooled over rounds")
    print(f"machine: read {machine['read_gb_s']:.1f} GB/s, {args.dtype} GEMM {machine['gemm_gflop_s']:.0f} GFLOP/s "
          f"(bfloat16 {machine['bf16_gemm_gflop_s']:.0f}, float32 {machine['float32_gemm_gflop_s']:.0f}); "
          f"weights {weight_bytes / 1e6:.0f} MB -> c=1 bound {bound_c1:.0f} tok/s, GEMM bound {bound_gemm:.0f} tok/s")
    print(f"{'workload':>8}  {'system':<14}{'conc':>5}{'tok/s':>9}{'TTFT p50':>10}{'TTFT p95':>10}{'TPOT p50':>10}"
          f"{'TPOT p95':>10}{'vs seq [min, max]':>22}{'vs batch [min, max]':>22}")
    for r in sorted(results, key=lambda r: (r.workload, r.system)):
        w = str(r.workload)
        vs_seq = fmt(ratio_seq[w]) if r.system == "edgeserve" and w in ratio_seq else ""
        vs_bat = fmt(ratio_bat[w]) if r.system == "edgeserve" and w in ratio_bat else ""
        print(f"{'c=' + w:>8}  {r.system:<14}{r.concurrency:>5}{r.output_tok_s:>9.1f}{r.ttft_p50_s:>10.3f}"
              f"{r.ttft_p95_s:>10.3f}{r.tpot_p50_s:>10.4f}{r.tpot_p95_s:>10.4f}{vs_seq:>22}{vs_bat:>22}")
    print("ratios: median over rounds of edgeserve / the system on the same requests in the same round")
    print("pct_of_bound: " + ", ".join(f"c={k}: {v:.0f}%" for k, v in pct.items())
          + "".join(f"; c={k} counting prompt tokens too: {v:.0f}% (on {'the full run' if args.quick else 'these'}"
                    f"'s requests, where every token at the GEMM rate would read {ceiling:.0f}%)"
                    for k, v in pct_all.items()))
    print("targets: " + ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in targets.items())
          + f"; took {total_s:.0f} s")

