"""`bench cpu-kernels`' linear and int4 sections: one decode step's linears on the C GEMVs against torch's."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ops.bench.cpu_kernels.timing import alternate, in_step, result_row
from ops.bench.harness.progress import log

__all__ = ["bench_linear", "bench_int4", "linear_shapes"]


def linear_shapes(cfg: Any) -> list[tuple[int, int]]:
    """(N, K) of one step's linears in order: each layer's fused QKV, output, fused gate/up, down; the LM head."""
    h, hd = cfg.hidden_size, cfg.head_dim
    layer = [((cfg.num_heads + 2 * cfg.num_kv_heads) * hd, h), (h, cfg.num_heads * hd),
             (2 * cfg.intermediate_size, h), (h, cfg.intermediate_size)]
    return layer * cfg.num_layers + [(cfg.vocab_size, h)]


def bench_linear(cfg: Any, rows: list[int], reps: int, machine: dict[str, float],
                  dtype: torch.dtype = torch.bfloat16) -> list[dict[str, Any]]:
    """The linear section (bfloat16 weights, `gemv_bf16`) or, with `dtype` float32, the linear_f32 one
    (`gemv_f32`, against torch's float32 GEMM)."""
    from kernels import cpu_gemv, cpu_gemv_f32

    f32 = dtype == torch.float32
    section, kernel = ("linear_f32", "gemv_f32") if f32 else ("linear", "gemv_bf16")
    gemv = cpu_gemv_f32.gemv_f32 if f32 else cpu_gemv.gemv_bf16
    shapes = linear_shapes(cfg)
    weights = [torch.randn(n, k).mul_(k ** -0.5).to(dtype) for n, k in shapes]
    params = sum(n * k for n, k in shapes)
    size = weights[0].element_size()
    out = []
    for m in rows:
        xs = {k: torch.randn(m, k).to(dtype) for k in {k for _, k in shapes}}
        times = alternate({"c": in_step(lambda: [gemv(xs[w.shape[1]], w) for w in weights]),
                           "torch": lambda: [F.linear(xs[w.shape[1]], w) for w in weights]}, reps)
        row = result_row(f"{section}_{m}", section, kernel, f"{m} rows x {len(weights)} linears", times,
                   2 * m * params, "GFLOP/s")
        gb_s = size * params / (row["c_ms"] * 1e-3) / 1e9
        row.update(rows=m, weight_bytes=size * params, c_weight_gb_s=gb_s,
                   pct_of_read_bw=100 * gb_s / machine["read_gb_s"],
                   pct_of_gemm_bound=100 * row["c_rate"] / machine["bound_gemm_gflop_s"])
        out.append(row)
        log(f"  {section} {m} rows: C {row['c_ms']:.1f} ms, torch {row['torch_ms']:.1f} ms")
    return out


def bench_int4(cfg: Any, rows: list[int], reps: int, group: int) -> list[dict[str, Any]]:
    from kernels import cpu_gemv_int4

    packed, theirs = [], []
    shapes = linear_shapes(cfg)
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
            "c": in_step(lambda: [cpu_gemv_int4.gemv_int4(xs[w.in_features], w) for w in packed]),
            "torch": lambda: [torch.ops.aten._weight_int4pack_mm_for_cpu(xs[k], w, group, sz)
                              for (w, sz), (_, k) in zip(theirs, shapes, strict=True)]}, reps)
        row = result_row(f"int4_{m}", "int4", "gemv_int4", f"{m} rows x {len(shapes)} linears, g{group}", times,
                   2 * m * params, "GFLOP/s")
        row.update(rows=m, weight_bytes=sum(p.nbytes for p in packed))
        out.append(row)
        log(f"  int4 {m} rows: C {row['c_ms']:.1f} ms, torch {row['torch_ms']:.1f} ms")
    return out
