"""Paged decode attention on CUDA: FP8 vs BF16 KV pages, by batch and context length.

Each row times `paged_decode_attention` (bf16 queries, automatic num_splits) over
pages laid out in a random order, with CUDA events (`triton.testing.do_bench`,
median). KV bytes are what the kernel must read: K and V of every context token
(values plus FP8 exponents); GB/s = KV bytes / time, and %bw compares that with
the device's read bandwidth measured in the same run (a large sum).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from ops.bench import write_report

__all__ = ["add_arguments", "run", "main"]

PAGE_SIZE = 16


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batches", default="1,32,64")
    p.add_argument("--contexts", default="1024,4096")
    p.add_argument("--heads", type=int, default=32, help="query heads (Llama-3-8B shape by default)")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)


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


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("bench kernels needs a CUDA device")
        return 1
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

    print(f"{torch.cuda.get_device_name()}: read bandwidth {bandwidth:.0f} GB/s; "
          f"q heads {args.heads}, kv heads {args.kv_heads}, head_dim {args.head_dim}, page {PAGE_SIZE}")
    print(f"{'format':<10}{'batch':>6}{'context':>8}{'splits':>7}{'us':>9}{'KV MB':>8}{'GB/s':>8}{'%bw':>6}"
          f"{'fp8 x':>7}")
    for r in rows:
        speedup = f"{r['fp8_speedup']:.2f}" if "fp8_speedup" in r else ""
        print(f"{r['format']:<10}{r['batch']:>6}{r['context']:>8}{r['num_splits']:>7}{r['us']:>9.1f}"
              f"{r['kv_mb']:>8.1f}{r['gb_s']:>8.0f}{r['pct_of_read_bw']:>6.0f}{speedup:>7}")
    report = {"device": torch.cuda.get_device_name(), "read_bandwidth_gb_s": bandwidth, "page_size": PAGE_SIZE,
              "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim, "results": rows}
    path = write_report(args.json_path, report)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    out = os.environ.get("OUT")
    p.add_argument("--json", dest="json_path",
                   default=str(Path(out) / "bench_kernels.json") if out else "bench-results/kernels.json")
    p.add_argument("--quick", action="store_true", help="one batch size and one context length")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
