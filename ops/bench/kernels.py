"""CUDA kernels: paged decode attention (FP8 vs BF16 pages), the fused MoE (vs torch), MLA decode.

`--parts attention,moe,mla` chooses the sections (attention and moe by default); `--parts mla`
also runs without a GPU, timing the torch reference only, and is what the default run does on a
host without one (the report lists the other parts under ``skipped``). The CPU's C kernels have
their own benchmark, `edgeserve bench cpu-kernels`.

**attention**: each row times `paged_decode_attention` (bf16 queries, automatic num_splits) over
pages laid out in a random order, with CUDA events (`triton.testing.do_bench`,
median). KV bytes are what the kernel must read: K and V of every context token
(values plus FP8 exponents); GB/s = KV bytes / time, and %bw compares that with
the device's read bandwidth measured in the same run (a large sum).

**moe**: one MoE layer's routed experts (`kernels.fused_moe.fused_moe`), GLM-4.5-Air's
shape by default (H 4096, I 1408, 128 experts, top-8), bf16 activations, random
distinct top-k per token, experts in bf16, fp8 (128 x 128 blocks) and int4 (g 128),
against the torch path: a loop over the hit experts of bf16 `F.linear`s on weights
already dense in bf16 (the best torch can do without a fused kernel: no per-call
dequantisation, at bf16's memory cost). GB/s = bytes of the hit experts' stored
weights (and scales) / fused time, the figure that bounds decode.

**mla**: absorbed MLA decode (`kernels.mla_decode.mla_decode_attention`, bf16 queries) over
latent pages in bf16 and fp8_e4m3 rows, Kimi K2.x / DeepSeek-V3 rows by default (R 512,
Dr 64) and 16 query heads (128 heads at TP 8), splits from `default_num_splits`, against
`mla_decode_ref` (a per-sequence torch loop). GB/s = latent bytes read / kernel time. On
CPU: the reference alone in float32 (wall clock, median of 5), first batch and context only.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from ops.bench.report import write_report

__all__ = ["add_arguments", "run", "main"]

PAGE_SIZE = 16


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batches", default="1,32,64")
    p.add_argument("--contexts", default="1024,4096")
    p.add_argument("--heads", type=int, default=32, help="query heads (Llama-3-8B shape by default)")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--parts", default=None, help="sections to run: attention, moe, mla (default: attention,moe "
                   "with a CUDA device, else mla, the others reported as skipped)")
    p.add_argument("--moe-tokens", default="1,16,128,1024")
    p.add_argument("--moe-shape", default="4096,1408,128,8", help="hidden, moe intermediate, experts, top-k")
    p.add_argument("--moe-formats", default="bf16,fp8,int4")
    p.add_argument("--mla-shape", default="512,64,16", help="kv_lora_rank, qk_rope_head_dim, query heads")


def _read_bandwidth_gb_s() -> float:
    from triton.testing import do_bench

    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").view(torch.float32)  # 1 GiB
    x.normal_()
    ms = do_bench(lambda: x.sum())
    return x.numel() * 4 / (ms * 1e-3) / 1e9


def _make_cache(fmt: str, batch: int, context: int, kv_heads: int, head_dim: int):
    """A random cache holding batch sequences of `context` tokens on shuffled pages."""
    pages_per_seq = -(-context // PAGE_SIZE)
    num_pages = batch * pages_per_seq
    shape = (num_pages, PAGE_SIZE, kv_heads, head_dim)  # [num_pages, PAGE_SIZE, num_kv_heads, head_dim]
    if fmt == "fp8_e4m3":
        k_cache, v_cache = ((torch.randn(shape, device="cuda") * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
                            for _ in range(2))
        k_scale, v_scale = (torch.randint(-8, 0, shape[:3], dtype=torch.int8, device="cuda") for _ in range(2))
    else:
        k_cache, v_cache = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        k_scale = v_scale = None
    page_table = torch.randperm(num_pages, device="cuda").int().view(batch, pages_per_seq)
    context_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    kv_bytes = 2 * batch * context * kv_heads * (head_dim * k_cache.element_size() + (1 if k_scale is not None else 0))
    return (k_cache, v_cache, k_scale, v_scale, page_table, context_lens), kv_bytes


def _bench_attention(args: argparse.Namespace) -> dict:
    from triton.testing import do_bench

    from kernels.paged_attention import default_num_splits, paged_decode_attention

    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    if getattr(args, "quick", False):
        batches, contexts = batches[:1], contexts[:1]
    bandwidth = _read_bandwidth_gb_s()
    scale = args.head_dim ** -0.5
    rows = []
    for context in contexts:
        for batch in batches:
            times = {}
            for fmt in ("bf16", "fp8_e4m3"):
                cache, kv_bytes = _make_cache(fmt, batch, context, args.kv_heads, args.head_dim)
                q = torch.randn(batch, args.heads, args.head_dim, device="cuda", dtype=torch.bfloat16)
                ms = do_bench(lambda: paged_decode_attention(q, *cache, scale))
                times[fmt] = ms
                gb_s = kv_bytes / (ms * 1e-3) / 1e9
                rows.append({"format": fmt, "batch": batch, "context": context, "us": ms * 1e3,
                             "kv_mb": kv_bytes / 1e6, "gb_s": gb_s, "pct_of_read_bw": 100 * gb_s / bandwidth,
                             "num_splits": default_num_splits(batch, args.kv_heads, context, q.device)})
                del cache
            rows[-1]["fp8_speedup"] = times["bf16"] / times["fp8_e4m3"]
    sweep = _sweep_attention(args, batches[-1], contexts[-1], bandwidth)

    print(f"{torch.cuda.get_device_name()}: read bandwidth {bandwidth:.0f} GB/s; "
          f"q heads {args.heads}, kv heads {args.kv_heads}, head_dim {args.head_dim}, page {PAGE_SIZE}")
    print(f"{'format':<10}{'batch':>6}{'context':>8}{'splits':>7}{'us':>9}{'KV MB':>8}{'GB/s':>8}{'%bw':>6}"
          f"{'fp8 x':>7}")
    for r in rows:
        speedup = f"{r['fp8_speedup']:.2f}" if "fp8_speedup" in r else ""
        print(f"{r['format']:<10}{r['batch']:>6}{r['context']:>8}{r['num_splits']:>7}{r['us']:>9.1f}"
              f"{r['kv_mb']:>8.1f}{r['gb_s']:>8.0f}{r['pct_of_read_bw']:>6.0f}{speedup:>7}")
    for fmt, runs in sweep.items():
        best = max(runs, key=lambda r: r["pct_of_read_bw"])
        print(f"{fmt} sweep at batch {batches[-1]}, context {contexts[-1]}: best {best['config']} "
              f"{best['us']:.1f} us, {best['pct_of_read_bw']:.0f}% of read bandwidth")
    return {"read_bandwidth_gb_s": bandwidth, "page_size": PAGE_SIZE, "heads": args.heads, "kv_heads": args.kv_heads,
            "head_dim": args.head_dim, "results": rows, "sweep": sweep}


def _sweep_attention(args: argparse.Namespace, batch: int, context: int, bandwidth: float) -> dict[str, list[dict]]:
    """The split kernel's tile (tokens), warps and pipeline stages at one shape, each format, FP8 pages with
    float16 dots (the default), with bfloat16 ones (`fp16_dots=False`) and with V read in pairs (`v_pairs`):
    what the defaults leave on the table."""
    from triton.testing import do_bench

    from kernels.paged_attention import paged_decode_attention

    scale = args.head_dim ** -0.5
    out: dict[str, list[dict]] = {}
    arms = (("bf16", "bf16", {}), ("fp8_e4m3", "fp8_e4m3", {}),
            ("fp8_e4m3_bf16_dots", "fp8_e4m3", {"fp16_dots": False}),
            ("fp8_e4m3_v_pairs", "fp8_e4m3", {"v_pairs": True}))
    for name, fmt, kw in arms:
        cache, kv_bytes = _make_cache(fmt, batch, context, args.kv_heads, args.head_dim)
        q = torch.randn(batch, args.heads, args.head_dim, device="cuda", dtype=torch.bfloat16)
        out[name] = []
        for block_n in (64, 128):
            for warps in (4, 8):
                for stages in (2, 4):
                    ms = do_bench(lambda: paged_decode_attention(q, *cache, scale, block_n=block_n, num_warps=warps,
                                                                 num_stages=stages, **kw), warmup=5, rep=20)
                    gb_s = kv_bytes / (ms * 1e-3) / 1e9
                    out[name].append({"config": f"n{block_n}w{warps}s{stages}", "us": ms * 1e3, "gb_s": gb_s,
                                      "pct_of_read_bw": 100 * gb_s / bandwidth})
        del cache
    return out


def _stored_experts(fmt: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Stacked bf16 expert weights [E, N, K] in `fmt`: {"w": ..., "scale": ..., "zeros": ...}."""
    from kernels.fp8_gemm import quantize_fp8_blocks_ref
    from kernels.w4a16_gemm import quantize_int4_ref

    if fmt == "bf16":
        return {"w": w}
    quantise = quantize_fp8_blocks_ref if fmt == "fp8" else (lambda m: quantize_int4_ref(m, 128))
    parts = [quantise(m) for m in w]
    return dict(zip(("w", "scale", "zeros"), (torch.stack(t) for t in zip(*parts))))


def _torch_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
               topk_ids: torch.Tensor) -> torch.Tensor:
    """The torch path: per hit expert, bf16 GEMMs on its gathered tokens, weighted, index_add'ed."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    flat, k, inter = topk_ids.reshape(-1), topk_ids.shape[1], w2.shape[2]
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        slots = order[start:start + count]
        start += count
        gate, up = torch.nn.functional.linear(x[slots // k], w13[expert]).split(inter, dim=1)
        y = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w2[expert])
        out.index_add_(0, slots // k, y.float() * topk_weights.reshape(-1)[slots, None])
    return out.to(x.dtype)


def _bench_moe(args: argparse.Namespace) -> list[dict]:
    from triton.testing import do_bench

    from kernels.fused_moe import fused_moe

    h, inter, experts, top_k = (int(v) for v in args.moe_shape.split(","))
    tokens_list = [int(t) for t in args.moe_tokens.split(",")]
    if getattr(args, "quick", False):
        tokens_list = tokens_list[:1] + tokens_list[-1:]
    w13 = torch.randn(experts, 2 * inter, h, device="cuda", dtype=torch.bfloat16) * h ** -0.5  # [E, 2I, H]
    w2 = torch.randn(experts, h, inter, device="cuda", dtype=torch.bfloat16) * inter ** -0.5  # [E, H, I]
    rows = []
    for fmt in args.moe_formats.split(","):
        s13, s2 = _stored_experts(fmt, w13), _stored_experts(fmt, w2)
        kwargs = {"fmt": fmt, "w13_scale": s13.get("scale"), "w2_scale": s2.get("scale"),
                  "w13_zeros": s13.get("zeros"), "w2_zeros": s2.get("zeros")}
        bytes_per_expert = sum(t[0].numel() * t.element_size() for t in (*s13.values(), *s2.values()))
        for tokens in tokens_list:
            x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)
            topk_ids = torch.rand(tokens, experts, device="cuda").topk(top_k, dim=1).indices  # [T, k] distinct
            topk_weights = torch.rand(tokens, top_k, device="cuda")
            hit = int(topk_ids.unique().numel())
            fused_ms = do_bench(lambda: fused_moe(x, s13["w"], s2["w"], topk_weights, topk_ids, **kwargs))
            torch_ms = do_bench(lambda: _torch_moe(x, w13, w2, topk_weights, topk_ids))
            rows.append({"format": fmt, "tokens": tokens, "experts_hit": hit, "fused_us": fused_ms * 1e3,
                         "torch_bf16_us": torch_ms * 1e3, "speedup": torch_ms / fused_ms,
                         "weight_gb_s": hit * bytes_per_expert / (fused_ms * 1e-3) / 1e9})
        del s13, s2
    print(f"fused MoE: hidden {h}, moe intermediate {inter}, {experts} experts, top-{top_k}, bf16 activations")
    print(f"{'format':<8}{'tokens':>7}{'hit':>5}{'fused us':>10}{'torch us':>10}{'x':>7}{'GB/s':>8}")
    for r in rows:
        print(f"{r['format']:<8}{r['tokens']:>7}{r['experts_hit']:>5}{r['fused_us']:>10.1f}"
              f"{r['torch_bf16_us']:>10.1f}{r['speedup']:>7.2f}{r['weight_gb_s']:>8.0f}")
    return rows


def _bench_mla(args: argparse.Namespace) -> dict:
    import statistics
    import timeit

    from triton.testing import do_bench

    from kernels.latent_kv_store import latent_row_bytes, quantize_latent_ref
    from kernels.mla_decode import BLOCK_H, mla_decode_attention, mla_decode_ref
    from kernels.paged_attention import default_num_splits

    rank, rope, heads = (int(v) for v in args.mla_shape.split(","))
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    if getattr(args, "quick", False) or not cuda:
        batches, contexts = batches[:1], contexts[:1]

    def timed_ms(fn) -> float:  # CUDA events on a GPU, else the median of 5 wall-clock runs
        return do_bench(fn) if cuda else statistics.median(timeit.repeat(fn, number=1, repeat=5)) * 1e3

    rows, scale = [], (rank // 4 + rope) ** -0.5  # 1/sqrt(qk_head_dim) with qk_nope = R / 4, as DeepSeek-V3
    for context in contexts:
        for batch in batches:
            pages_per_seq = -(-context // PAGE_SIZE)
            num_pages = batch * pages_per_seq
            page_table = torch.randperm(num_pages, device=device).int().view(batch, pages_per_seq)
            context_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
            q_latent = torch.randn(batch, heads, rank, device=device, dtype=dtype)
            q_pe = torch.randn(batch, heads, rope, device=device, dtype=dtype)
            splits = default_num_splits(batch, -(-heads // BLOCK_H), context, q_latent.device)
            for fmt in ("bf16", "fp8_e4m3") if cuda else ("fp32",):
                pages = quantize_latent_ref(torch.randn(num_pages, PAGE_SIZE, rank, device=device),
                                            torch.randn(num_pages, PAGE_SIZE, rope, device=device), fmt)
                args_ = (q_latent, q_pe, pages, fmt, rank, rope, page_table, context_lens, scale, splits)
                row = {"format": fmt, "batch": batch, "context": context, "num_kv_splits": splits,
                       "kv_mb": batch * context * latent_row_bytes(rank, rope, fmt) / 1e6,
                       "ref_us": timed_ms(lambda: mla_decode_ref(*args_)) * 1e3}
                if cuda:
                    row["kernel_us"] = timed_ms(lambda: mla_decode_attention(*args_)) * 1e3
                    row["speedup_vs_ref"] = row["ref_us"] / row["kernel_us"]
                    row["gb_s"] = row["kv_mb"] * 1e6 / (row["kernel_us"] * 1e-6) / 1e9
                rows.append(row)
                del pages
    print(f"MLA decode on {device}: R {rank}, Dr {rope}, {heads} heads, page {PAGE_SIZE}, {dtype} queries")
    print(f"{'format':<10}{'batch':>6}{'context':>8}{'splits':>7}{'KV MB':>8}{'ref us':>10}"
          + (f"{'kernel us':>11}{'x':>7}{'GB/s':>7}" if cuda else ""))
    for r in rows:
        kernel = f"{r['kernel_us']:>11.1f}{r['speedup_vs_ref']:>7.1f}{r['gb_s']:>7.0f}" if cuda else ""
        print(f"{r['format']:<10}{r['batch']:>6}{r['context']:>8}{r['num_kv_splits']:>7}{r['kv_mb']:>8.1f}"
              f"{r['ref_us']:>10.1f}{kernel}")
    return {"kv_lora_rank": rank, "rope_dim": rope, "heads": heads, "page_size": PAGE_SIZE, "results": rows}


def run(args: argparse.Namespace) -> int:
    cuda = torch.cuda.is_available()
    report: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu"}
    if args.parts is None and not cuda:  # the default run on a CPU host: what can run, and what could not
        parts = ["mla"]
        report["skipped"] = {"attention": "no CUDA device", "moe": "no CUDA device"}
        print("bench kernels: attention and moe need a CUDA device (skipped); the CPU's own kernels are "
              "`edgeserve bench cpu-kernels`")
    else:
        parts = (args.parts or "attention,moe").split(",")
    if not cuda and parts != ["mla"]:
        print("bench kernels needs a CUDA device (without one, only --parts mla runs: the torch reference)")
        return 1
    if "attention" in parts:
        report.update(_bench_attention(args))
    if "moe" in parts:
        h, inter, experts, top_k = (int(v) for v in args.moe_shape.split(","))
        report["fused_moe"] = {"hidden": h, "moe_intermediate": inter, "experts": experts, "top_k": top_k,
                               "results": _bench_moe(args)}
    if "mla" in parts:
        report["mla_decode"] = _bench_mla(args)
    write_report(args.json_path, report)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    out = os.environ.get("OUT")
    p.add_argument("--json", dest="json_path",
                   default=str(Path(out) / "bench_kernels.json") if out else "bench-results/kernels.json")
    p.add_argument("--quick", action="store_true",
                   help="one batch size and one context length; the first and last MoE token counts")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
