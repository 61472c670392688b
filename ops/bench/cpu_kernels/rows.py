"""`bench cpu-kernels`' rows section: the element-wise kernels of a step against their torch expressions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ops.bench.cpu_kernels.timing import alternate, in_step, result_row

__all__ = ["bench_rows"]


def bench_rows(cfg: Any, rows: list[int], reps: int) -> list[dict[str, Any]]:
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
            times = alternate({"c": in_step(repeat(c_call)), "torch": repeat(torch_call)}, reps)
            row = result_row(f"{kernel}_{m}", "rows", kernel, f"{m} rows, {per_step} calls a step", times)
            row.update(rows=m, calls_per_step=per_step, c_us_per_call=row["c_ms"] * 1e3 / per_step,
                       torch_us_per_call=row["torch_ms"] * 1e3 / per_step)
            out.append(row)
    return out
