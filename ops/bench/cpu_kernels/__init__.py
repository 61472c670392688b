"""The CPU's C kernels against the torch ops they replace, at a model's decode shapes.

Every C kernel of `kernels/cpu/` stands in for torch ops the engine would otherwise run
(`backend/linear.py`, `backend/attention.py`, `backend/layers/norm.py`, `backend/rope.py`,
the MLP's activation, greedy sampling). This benchmark times each against that torch path on
the same random inputs, in the shapes one decode step of `--model` gives them (its config
only: no weights are read), so the figures the kernels' own comments quote can be re-run.

- **linear**: one step's linear layers, every layer's own weights (the fused QKV and gate/up
  projections, the output and down projections, the LM head; random bfloat16), at `--rows`
  rows: `kernels.cpu_gemv.gemv_bf16` against `F.linear` in bfloat16. Each timed pass goes over
  all the layers, so the weights stream from memory as in a step. GFLOP/s and the share of the
  machine's GEMM bound (torch's best 2048^3 GEMM, measured in the same run, the rate
  `bench engine`'s "% of GEMM bound" uses); the weights' bytes a second and their share of the
  read bandwidth measured in the same run (what bounds a step of one row).
- **linear_f32**: the same pass over float32 weights (a `--dtype float32` model's): `kernels.cpu_gemv_f32.gemv_f32`
  against `F.linear` in float32 (MKL), the comparison that sets up to how many rows a float32 step takes the kernel
  (`cpu_gemv_f32.max_rows`).
- **int4**: the same pass with INT4 weights (group `--int4-group-size`):
  `kernels.cpu_gemv_int4.gemv_int4` against torch's `_weight_int4pack_mm_for_cpu`.
- **attention**: decode rows (`--attention-rows` sequences of `--context` keys each, the
  model's query and KV heads, pages in a shuffled order) over every layer of the engine's own
  page pool (`PagedKVCache`, random contents): `paged_decode_attention_cpu` against the engine's
  torch path (`PagedKVCache.gather`, which dequantises fp8, then SDPA under the additive mask),
  for bf16 and fp8_e4m3 pages. GB/s = KV bytes / time. Where the kernel runs decode rows on AMX tiles
  (fp8 pages; bf16 from 128 keys), its vector copy takes turns with the two as a third arm (`vector_ms`,
  `vector_over_c`: > 1, the tiles are faster).
- **prompt**: a prompt chunk of `--prompt-rows` rows, fresh and after `--context` cached keys, in the tiles the
  engine groups it into, against backend/attention.py's torch path for a chunk (pages gathered once, SDPA under
  the causal mask), with the vector copy as a third arm where the AMX tiles take it. Over fp8 pages the kernel
  runs on the chunk's pages dequantised first, as the engine runs it where the kernel can dequantise, and over
  the fp8 pages in place as a fourth arm (`in_place_ms`, `in_place_over_c`).
- **rows**: the element-wise kernels at 1 and `max(--rows)` rows: residual add + RMSNorm,
  SwiGLU's activation, RoPE, argmax over the vocabulary, the argmax under grammar mask words
  (half the tokens allowed) and temperature sampling, plain and with top-p 0.9, against their
  torch expressions (for the last three, the sampler's torch path: bit unpacking and masked_fill;
  float32 copy, division, softmax, float64 running sum and searchsorted; the same after a sort
  for top-p). The
  input is the same tensor every call (in a step it was just written, so it is in cache).

The C kernels run as in a decode step, inside `torch_single_threaded` (torch at one thread,
the C kernels' helper pool on the other cores); the torch ops at torch's own thread count, as
the engine runs them where a kernel is missing. Within a section the two sides alternate pass
by pass (`--reps` rounds, who goes first rotating, a pause before each pass so that torch's
spinning OpenMP workers do not slow the pass after theirs); each figure is the median pass,
`torch/C` the ratio of medians (> 1: the kernel is faster) and, beside it, the lowest and highest
ratio of one round's two passes (the JSON keeps every pass). A kernel that does not build here (no
compiler, neither AVX512-BF16 nor AVX2 for the GEMVs) is reported as unavailable, with the reason, and its rows
are left out.

The sections live in `linear.py` (linear, linear_f32, int4), `attention.py` (attention, prompt) and
`rows.py`; `timing.py` holds the alternating timer and the result row they share.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from ops.bench.cpu_kernels.attention import bench_attention, bench_prompt
from ops.bench.cpu_kernels.linear import bench_int4, bench_linear
from ops.bench.cpu_kernels.rows import bench_rows
from ops.bench.cpu_kernels.timing import alternate
from ops.bench.harness.machine import measure_machine
from ops.bench.harness.progress import log
from ops.bench.report import write_report

__all__ = ["add_arguments", "run", "alternate"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="model whose config gives the shapes")
    p.add_argument("--sections", default="linear,linear_f32,int4,attention,prompt,rows")
    p.add_argument("--rows", default=None, help="rows (tokens) of a linear call (default 1,8,32,128; quick 1,32)")
    p.add_argument("--attention-rows", type=int, default=32, help="decode sequences of the attention section")
    p.add_argument("--prompt-rows", type=int, default=100, help="rows of the prompt section's chunk")
    p.add_argument("--context", type=int, default=None, help="keys per sequence (default 512; quick 256)")
    p.add_argument("--int4-group-size", type=int, default=32, help="INT4 group (divides the in-features)")
    p.add_argument("--reps", type=int, default=None, help="rounds of one C and one torch pass (default 7; quick 3)")


def run(args: argparse.Namespace) -> int:
    from backend.config import load_config
    from ops.pull import resolve_model

    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    rows = [int(r) for r in (args.rows or ("1,32" if args.quick else "1,8,32,128")).split(",")]
    reps = args.reps or (3 if args.quick else 7)
    context = args.context or (256 if args.quick else 512)
    cfg = load_config(resolve_model(args.model))
    torch.manual_seed(0)
    machine = measure_machine(torch.bfloat16)
    log(f"cpu-kernels: {args.model}, {torch.get_num_threads()} threads, GEMM bound "
        f"{machine['bound_gemm_gflop_s']:.0f} GFLOP/s, read {machine['read_gb_s']:.1f} GB/s")
    from kernels import (cpu_argmax, cpu_gemv, cpu_gemv_f32, cpu_gemv_int4, cpu_paged_attention, cpu_rms_norm,
                         cpu_rope, cpu_sample, cpu_silu_mul)

    needs = {"linear": [cpu_gemv], "linear_f32": [cpu_gemv_f32], "int4": [cpu_gemv_int4],
             "attention": [cpu_paged_attention], "prompt": [cpu_paged_attention],
             "rows": [cpu_rms_norm, cpu_silu_mul, cpu_rope, cpu_argmax, cpu_sample]}
    results: list[dict[str, Any]] = []
    unavailable: dict[str, str] = {}
    for section in sections:
        missing = {m.__name__: m.build_error() or "unavailable" for m in needs[section] if not m.available()}
        if missing:
            unavailable[section] = "; ".join(f"{k}: {v}" for k, v in missing.items())
            log(f"  {section}: skipped ({unavailable[section]})")
            continue
        log(f"{section} ...")
        if section == "linear":
            results += bench_linear(cfg, rows, reps, machine)
        elif section == "linear_f32":
            results += bench_linear(cfg, rows, reps, machine, torch.float32)
        elif section == "int4":
            results += bench_int4(cfg, rows, reps, args.int4_group_size)
        elif section == "attention":
            results += bench_attention(cfg, args.attention_rows, context, reps)
        elif section == "prompt":  # a fresh prompt's chunk, and one after `context` cached keys
            results += [r for prefix in (0, context) for r in bench_prompt(cfg, args.prompt_rows, prefix, reps)]
        else:
            results += bench_rows(cfg, sorted({1, max(rows)}), reps)
    _print(results, unavailable)
    # the GEMV's share of the GEMM bound first: a summary table shows only a headline's first figures
    headline = {f"pct_of_gemm_bound.{r['key']}": round(r["pct_of_gemm_bound"], 1)
                for r in results if "pct_of_gemm_bound" in r}
    headline.update({f"torch_over_c.{r['key']}": round(r["torch_over_c"], 3) for r in results})
    write_report(args.json_path, {"model": args.model, "threads": torch.get_num_threads(), "reps": reps,
                                  "bench_machine": machine, "results": results, "unavailable": unavailable,
                                  "headline": headline})
    return 0


def _print(results: list[dict[str, Any]], unavailable: dict[str, str]) -> None:
    print(f"\n{'section':<10}{'kernel':<28}{'shape':<44}{'C ms':>9}{'torch ms':>10}{'torch/C':>9}"
          f"{'rounds':>14}  C rate")
    for r in results:
        rate = f"{r['c_rate']:.1f} {r['unit']}" if "unit" in r else ""
        if "pct_of_gemm_bound" in r:
            rate += f" ({r['pct_of_gemm_bound']:.0f}% of GEMM bound, {r['pct_of_read_bw']:.0f}% of read bw)"
        lo, hi = r["torch_over_c_rounds"]
        print(f"{r['section']:<10}{r['kernel']:<28}{r['shape']:<44}{r['c_ms']:>9.2f}{r['torch_ms']:>10.2f}"
              f"{r['torch_over_c']:>8.2f}x{f'[{lo:.2f}, {hi:.2f}]':>14}  {rate}")
    for section, why in unavailable.items():
        print(f"{section}: not run ({why})")
