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
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ops.bench.harness.machine import measure_machine
from ops.bench.harness.progress import log
from ops.bench.report import write_report

__all__ = ["add_arguments", "run", "alternate"]

PAGE_SIZE = 16  # the engine's default (`EngineConfig.page_size`)
# a pause before each timed pass: torch's OpenMP workers spin for milliseconds after a parallel region
# (kernels/cpu_threads.py), which would slow whichever pass follows a torch pass
SETTLE_S = 0.05


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="model whose config gives the shapes")
    p.add_argument("--sections", default="linear,linear_f32,int4,attention,prompt,rows")
    p.add_argument("--rows", default=None, help="rows (tokens) of a linear call (default 1,8,32,128; quick 1,32)")
    p.add_argument("--attention-rows", type=int, default=32, help="decode sequences of the attention section")
    p.add_argument("--prompt-rows", type=int, default=100, help="rows of the prompt section's chunk")
    p.add_argument("--context", type=int, default=None, help="keys per sequence (default 512; quick 256)")
    p.add_argument("--int4-group-size", type=int, default=32, help="INT4 group (divides the in-features)")
    p.add_argument("--reps", type=int, default=None, help="rounds of one C and one torch pass (default 7; quick 3)")


def alternate(calls: dict[str, Callable[[], Any]], reps: int, settle_s: float = SETTLE_S) -> dict[str, list[float]]:
    """Seconds of each call in each of `reps` rounds (after one untimed round), the calls taking turns (who goes
    first rotates) with a pause of `settle_s` before each timed call."""
    for call in calls.values():
        call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(reps):
        names = list(calls)[r % len(calls):] + list(calls)[:r % len(calls)]
        for name in names:
            time.sleep(settle_s)
            t = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - t)
    return times


def _in_step(fn: Callable[[], Any]) -> Callable[[], Any]:
    """fn run as a decode step runs the C kernels: torch's threads handed over to their pool."""
    from kernels.cpu_threads import torch_single_threaded

    def call() -> Any:
        with torch_single_threaded():
            return fn()
    return call


def _row(key: str, section: str, kernel: str, shape: str, runs: dict[str, list[float]], work: float = 0.0,
         unit: str = "") -> dict[str, Any]:
    """One result from `alternate`'s runs: median times, their ratio and the spread of the rounds' own ratios;
    `key` names it in the headline; `work` (FLOP or bytes) over the median times gives the rates."""
    c, t = statistics.median(runs["c"]), statistics.median(runs["torch"])
    per_round = [b / a for a, b in zip(runs["c"], runs["torch"], strict=True)]
    out = {"key": key, "section": section, "kernel": kernel, "shape": shape, "c_ms": c * 1e3, "torch_ms": t * 1e3,
           "torch_over_c": t / c, "torch_over_c_rounds": [min(per_round), max(per_round)],
           "c_ms_runs": [x * 1e3 for x in runs["c"]], "torch_ms_runs": [x * 1e3 for x in runs["torch"]]}
    if unit:
        out.update({"unit": unit, "c_rate": work / c / 1e9, "torch_rate": work / t / 1e9})
    return out


def _linear_shapes(cfg: Any) -> list[tuple[int, int]]:
    """(N, K) of one step's linears in order: each layer's fused QKV, output, fused gate/up, down; the LM head."""
    h, hd = cfg.hidden_size, cfg.head_dim
    layer = [((cfg.num_heads + 2 * cfg.num_kv_heads) * hd, h), (h, cfg.num_heads * hd),
             (2 * cfg.intermediate_size, h), (h, cfg.intermediate_size)]
    return layer * cfg.num_layers + [(cfg.vocab_size, h)]


def _bench_linear(cfg: Any, rows: list[int], reps: int, machine: dict[str, float],
                  dtype: torch.dtype = torch.bfloat16) -> list[dict[str, Any]]:
    """The linear section (bfloat16 weights, `gemv_bf16`) or, with `dtype` float32, the linear_f32 one
    (`gemv_f32`, against torch's float32 GEMM)."""
    from kernels import cpu_gemv, cpu_gemv_f32

    f32 = dtype == torch.float32
    section, kernel = ("linear_f32", "gemv_f32") if f32 else ("linear", "gemv_bf16")
    gemv = cpu_gemv_f32.gemv_f32 if f32 else cpu_gemv.gemv_bf16
    shapes = _linear_shapes(cfg)
    weights = [torch.randn(n, k).mul_(k ** -0.5).to(dtype) for n, k in shapes]
    params = sum(n * k for n, k in shapes)
    size = weights[0].element_size()
    out = []
    for m in rows:
        xs = {k: torch.randn(m, k).to(dtype) for k in {k for _, k in shapes}}
        times = alternate({"c": _in_step(lambda: [gemv(xs[w.shape[1]], w) for w in weights]),
                           "torch": lambda: [F.linear(xs[w.shape[1]], w) for w in weights]}, reps)
        row = _row(f"{section}_{m}", section, kernel, f"{m} rows x {len(weights)} linears", times,
                   2 * m * params, "GFLOP/s")
        gb_s = size * params / (row["c_ms"] * 1e-3) / 1e9
        row.update(rows=m, weight_bytes=size * params, c_weight_gb_s=gb_s,
                   pct_of_read_bw=100 * gb_s / machine["read_gb_s"],
                   pct_of_gemm_bound=100 * row["c_rate"] / machine["bound_gemm_gflop_s"])
        out.append(row)
        log(f"  {section} {m} rows: C {row['c_ms']:.1f} ms, torch {row['torch_ms']:.1f} ms")
    return out


def _bench_int4(cfg: Any, rows: list[int], reps: int, group: int) -> list[dict[str, Any]]:
    from kernels import cpu_gemv_int4

    packed, theirs = [], []
    shapes = _linear_shapes(cfg)
    for n, k in shapes:
        codes = torch.randint(0, 16, (n, k), dtype=torch.int32)
        scales = (torch.rand(n, k // group) * 0.01 + 1e-3).bfloat16()
        zeros = (torch.randn(n, k // group) * 0.01).bfloat16()
        packed.append(cpu_gemv_int4.pack(codes, scales, zeros, group))
        theirs.append((torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1),
                       torch.stack([scales.t(), zeros.t()], dim=-1).contiguous()))
    params = sum(n * k for n, k in shapes)
    out = []
    for m in rows:
        xs = {k: torch.randn(m, k).bfloat16() for k in {k for _, k in shapes}}
        times = alternate({
            "c": _in_step(lambda: [cpu_gemv_int4.gemv_int4(xs[w.in_features], w) for w in packed]),
            "torch": lambda: [torch.ops.aten._weight_int4pack_mm_for_cpu(xs[k], w, group, sz)
                              for (w, sz), (_, k) in zip(theirs, shapes, strict=True)]}, reps)
        row = _row(f"int4_{m}", "int4", "gemv_int4", f"{m} rows x {len(shapes)} linears, g{group}", times,
                   2 * m * params, "GFLOP/s")
        row.update(rows=m, weight_bytes=sum(p.nbytes for p in packed))
        out.append(row)
        log(f"  int4 {m} rows: C {row['c_ms']:.1f} ms, torch {row['torch_ms']:.1f} ms")
    return out


def _random_cache(cfg: Any, fmt: str, num_pages: int) -> Any:
    """The engine's own page pool (`PagedKVCache`, every layer) filled with random keys and values."""
    from backend.kv_cache import PagedKVCache

    cache = PagedKVCache(cfg, fmt, num_pages, PAGE_SIZE, torch.bfloat16)
    x = torch.randn(cache.pages.shape)
    if cache.quantised:
        cache.pages.copy_(x.mul_(64).clamp_(-448, 448).to(torch.float8_e4m3fn))
        cache.scales.copy_(torch.randint(-8, 0, cache.scales.shape, dtype=torch.int8))
    else:
        cache.pages.copy_(x)
    return cache


def _attention_row(key: str, section: str, shape: str, ours: Callable[[], Any], theirs: Callable[[], Any],
                   reps: int, kv_bytes: float, others: dict[str, Callable[[], Any]] | None = None) -> dict[str, Any]:
    """The kernel (as in a decode step) against torch's path, and where its AMX tiles take the rows (this process
    runs them: `amx_default`) its vector copy as a third arm (`vector_ms`, `vector_over_c`: > 1, the tiles are
    faster); `others`: more ways of running the kernel, each an arm (`NAME_ms`, `NAME_over_c`)."""
    from kernels.cpu_paged_attention import amx_default, amx_tiles

    calls = {"c": _in_step(ours), "torch": theirs, **{name: _in_step(f) for name, f in (others or {}).items()}}
    if amx_default() and amx_tiles(True):

        def vector() -> Any:
            amx_tiles(False)
            try:
                return ours()
            finally:
                amx_tiles(True)
        calls["vector"] = _in_step(vector)
    times = alternate(calls, reps)
    row = _row(key, section, "paged_decode_attention_cpu", shape, times, kv_bytes, "GB/s")
    for name in [*(others or {}), *(["vector"] if "vector" in times else [])]:
        ms = statistics.median(times[name]) * 1e3
        row.update({f"{name}_ms": ms, f"{name}_over_c": ms / row["c_ms"],
                    f"{name}_ms_runs": [x * 1e3 for x in times[name]]})
    log(f"  {key}: C {row['c_ms']:.1f} ms, torch {row['torch_ms']:.1f} ms"
        + "".join(f", {name} {row[name + '_ms']:.1f} ms ({row[name + '_over_c']:.2f}x C's)" for name in others or {})
        + (f", the C vector copy {row['vector_ms']:.1f} ms (AMX tiles {row['vector_over_c']:.2f}x faster)"
           if "vector_ms" in row else ""))
    return row


def _kv_bytes(cache: Any, layers: int, rows: int, kvh: int, hd: int) -> int:
    """Bytes of K and V pages (and FP8 exponents) `rows` token rows of every layer hold."""
    return layers * 2 * rows * kvh * (hd * (1 if cache.quantised else 2) + cache.quantised)


def _bench_attention(cfg: Any, d: int, context: int, reps: int) -> list[dict[str, Any]]:
    from backend.attention import context_mask
    from kernels.cpu_paged_attention import paged_decode_attention_cpu

    heads, kvh, hd, layers = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers
    scale = hd ** -0.5
    pages_per_seq = -(-context // PAGE_SIZE)
    table = torch.randperm(d * pages_per_seq).view(d, pages_per_seq)  # pages in a shuffled order
    lens = torch.full((d,), context, dtype=torch.int32)
    q = torch.randn(d, heads, hd).bfloat16()
    mask = context_mask(lens, pages_per_seq, PAGE_SIZE, q.dtype)
    out = []
    for fmt in ("bf16", "fp8_e4m3"):
        cache = _random_cache(cfg, fmt, d * pages_per_seq)

        def ours(cache: Any = cache) -> list:
            return [paged_decode_attention_cpu(q, kv.k, kv.v, kv.k_scale, kv.v_scale, table, lens, scale)
                    for kv in map(cache.layer, range(layers))]

        def theirs(cache: Any = cache) -> list:  # backend/attention.py's path without the kernel
            qd = q.view(d, kvh, heads // kvh, hd)
            return [F.scaled_dot_product_attention(qd, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                                   scale=scale)
                    for k, v in (cache.gather(i, table) for i in range(layers))]

        row = _attention_row(f"attention_{fmt}", "attention", f"{fmt} pages, {d} seq x {context} keys x {layers} "
                             "layers", ours, theirs, reps, _kv_bytes(cache, layers, d * context, kvh, hd))
        row.update(format=fmt, rows=d, context=context)
        out.append(row)
        del cache
    return out


def _bench_prompt(cfg: Any, n: int, prefix: int, reps: int) -> list[dict[str, Any]]:
    """A prompt chunk of n rows after `prefix` cached keys, in the kernel's tiles as the engine groups them
    (`tile_rows`), against backend/attention.py's torch path for a chunk (its pages gathered once, SDPA under the
    causal mask with the prefix), bf16 queries over bf16 and fp8 pages. Over fp8 pages the kernel runs as the
    engine runs it, over the chunk's pages dequantised first (`dequantised_pages`), and over the fp8 pages in
    place as another arm (`in_place_ms`)."""
    from kernels.cpu_paged_attention import dequantised_pages, dequantises, paged_decode_attention_cpu, tile_rows

    heads, kvh, hd, layers = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers
    g, ctx, scale = heads // kvh, prefix + n, hd ** -0.5
    pages = -(-ctx // PAGE_SIZE)
    table = torch.randperm(pages).view(1, pages).expand(n, pages).contiguous()  # every row the sequence's pages
    lens = torch.arange(prefix + 1, ctx + 1, dtype=torch.int32)  # row i sees the keys up to its own position
    tiles = torch.tensor([*range(0, n, tile_rows(g)), n], dtype=torch.int32)
    q = torch.randn(n, heads, hd).bfloat16()
    mask = torch.arange(ctx).unsqueeze(0) <= torch.arange(prefix, ctx).repeat(g).unsqueeze(1)  # [g n, ctx]
    out = []
    for fmt in ("bf16", "fp8_e4m3"):
        cache = _random_cache(cfg, fmt, pages)

        def in_place(cache: Any = cache) -> list:
            return [paged_decode_attention_cpu(q, kv.k, kv.v, kv.k_scale, kv.v_scale, table, lens, scale, tiles=tiles)
                    for kv in map(cache.layer, range(layers))]

        def dequantised(cache: Any = cache) -> list:  # backend/attention.py's path over fp8 pages
            own = torch.arange(pages).expand(n, pages)
            return [paged_decode_attention_cpu(q, dequantised_pages(kv.k, kv.k_scale, table[0], q.dtype),
                                               dequantised_pages(kv.v, kv.v_scale, table[0], q.dtype), None, None,
                                               own, lens, scale, tiles=tiles)
                    for kv in map(cache.layer, range(layers))]

        def theirs(cache: Any = cache) -> list:
            qp = q.permute(1, 0, 2).reshape(1, kvh, g * n, hd)
            return [F.scaled_dot_product_attention(qp, k[:, :ctx].transpose(1, 2), v[:, :ctx].transpose(1, 2),
                                                   attn_mask=mask, scale=scale)
                    for k, v in (cache.gather(i, table[:1]) for i in range(layers))]

        deq = cache.quantised and dequantises(hd)
        row = _attention_row(f"prompt_{fmt}_{prefix}", "prompt", f"{fmt} pages, {n} rows after {prefix} keys x "
                             f"{layers} layers", dequantised if deq else in_place, theirs, reps,
                             _kv_bytes(cache, layers, ctx, kvh, hd), {"in_place": in_place} if deq else None)
        row.update(format=fmt, rows=n, prefix=prefix)
        out.append(row)
        del cache
    return out


def _bench_rows(cfg: Any, rows: list[int], reps: int) -> list[dict[str, Any]]:
    from kernels.cpu_argmax import argmax_rows
    from kernels.cpu_rms_norm import add_rms_norm_bf16
    from kernels.cpu_sample import sample_rows
    from kernels.cpu_rope import rope_bf16
    from kernels.cpu_silu_mul import silu_mul_bf16

    h, inter, hd, eps = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.rms_norm_eps
    heads = cfg.num_heads + cfg.num_kv_heads
    layers = cfg.num_layers
    out = []
    for m in rows:
        hs, delta, w = torch.randn(m, h).bfloat16(), torch.randn(m, h).bfloat16(), torch.randn(h).bfloat16()
        gate_up = torch.randn(m, 2 * inter).bfloat16()
        x = torch.randn(m, heads, hd).bfloat16()
        freqs = torch.polar(torch.ones(m, 1, hd // 2), torch.rand(m, 1, hd // 2) * 6.28)
        logits = torch.randn(m, cfg.vocab_size).bfloat16()
        words = torch.randint(-2**31, 2**31 - 1, (m, (cfg.vocab_size + 31) // 32), dtype=torch.int32)
        inv_t, u = torch.full((m,), 1 / 0.7), torch.rand(m, dtype=torch.float64)
        bit = torch.arange(32, dtype=torch.int32)  # bit i of a mask word is token 32 * word + i
        top_p = torch.full((m,), 0.9)

        def torch_masked_argmax() -> torch.Tensor:  # backend/grammar.py's apply_masks without the kernel
            allowed = ((words.unsqueeze(-1) >> bit) & 1).flatten(1)[:, : logits.shape[1]].bool()
            return logits.float().masked_fill(~allowed, float("-inf")).argmax(dim=-1)

        def torch_sample() -> torch.Tensor:  # backend/sampler.py's torch path for plain temperature rows
            cdf = (logits.float() * inv_t.unsqueeze(1)).softmax(dim=-1).cumsum(dim=-1, dtype=torch.float64)
            return torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True)

        def torch_sample_top_p() -> torch.Tensor:  # the sampler's torch path for a top-p row, before the draw
            x = logits.float() * inv_t.unsqueeze(1)
            ordered = x.sort(dim=-1, descending=True).values
            probs = ordered.softmax(dim=-1)
            kept = ((probs.cumsum(dim=-1) - probs) <= 0.9).sum(dim=-1, keepdim=True).clamp_(min=1)
            x = x.masked_fill(x < ordered.gather(1, kept - 1), float("-inf"))
            cdf = x.softmax(dim=-1).cumsum(dim=-1, dtype=torch.float64)
            return torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True)

        def torch_rope() -> torch.Tensor:  # RotaryEmbedding.apply's torch path
            pairs = torch.view_as_complex(x.float().reshape(m, heads, hd // 2, 2))
            return torch.view_as_real(pairs * freqs).reshape(m, heads, hd).to(x.dtype)

        cases = [  # kernel, C call, torch call, calls per step
            ("add_rms_norm_bf16", lambda: add_rms_norm_bf16(hs, delta, w, eps),
             lambda: w * F.rms_norm(hs.add_(delta).float(), (h,), eps=eps).to(hs.dtype), 2 * layers),
            ("silu_mul_bf16", lambda: silu_mul_bf16(gate_up),
             lambda: F.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:]), layers),
            ("rope_bf16", lambda: rope_bf16(x, freqs), torch_rope, layers),
            ("argmax_rows", lambda: argmax_rows(logits), lambda: logits.argmax(dim=-1), 1),
            ("argmax_rows_masked", lambda: argmax_rows(logits, words), torch_masked_argmax, 1),
            ("sample_rows", lambda: sample_rows(logits, inv_t, u), torch_sample, 1),
            ("sample_rows_top_p", lambda: sample_rows(logits, inv_t, u, None, None, top_p), torch_sample_top_p, 1),
        ]
        for kernel, c_call, torch_call, per_step in cases:
            def repeat(f: Callable[[], Any], n: int = per_step) -> Callable[[], None]:
                return lambda: [f() for _ in range(n)]
            times = alternate({"c": _in_step(repeat(c_call)), "torch": repeat(torch_call)}, reps)
            row = _row(f"{kernel}_{m}", "rows", kernel, f"{m} rows, {per_step} calls a step", times)
            row.update(rows=m, calls_per_step=per_step, c_us_per_call=row["c_ms"] * 1e3 / per_step,
                       torch_us_per_call=row["torch_ms"] * 1e3 / per_step)
            out.append(row)
    return out


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
            results += _bench_linear(cfg, rows, reps, machine)
        elif section == "linear_f32":
            results += _bench_linear(cfg, rows, reps, machine, torch.float32)
        elif section == "int4":
            results += _bench_int4(cfg, rows, reps, args.int4_group_size)
        elif section == "attention":
            results += _bench_attention(cfg, args.attention_rows, context, reps)
        elif section == "prompt":  # a fresh prompt's chunk, and one after `context` cached keys
            results += [r for prefix in (0, context) for r in _bench_prompt(cfg, args.prompt_rows, prefix, reps)]
        else:
            results += _bench_rows(cfg, sorted({1, max(rows)}), reps)
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
