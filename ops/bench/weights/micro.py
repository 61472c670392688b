"""`bench weights`' micro-measurements: the timings behind the CPU runtime's choices of weight formats."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["micro"]


def _time_call(fn, reps: int) -> float:
    """Median seconds of fn() over `reps` calls (after one warm-up)."""
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def micro(engines: dict[str, Any], speed_formats: Iterable[str]) -> dict[str, float]:
    """The measurements behind the CPU runtime choices (milliseconds); `engines` holds one per name of
    `speed_formats`, and "fp32"."""
    from backend.linear import Int4Linear
    from backend.weight_formats import weight_format

    fp32 = engines["fp32"].model
    layer = fp32.phase_layers["decode"][0]
    out: dict[str, float] = {}
    hidden = torch.randn(1, layer.qkv.weight.shape[1])
    inner = torch.randn(1, layer.down.weight.shape[1])
    for name in speed_formats:  # the linear layers of one forward at M = 1 (one decode step at c = 1)
        layers = engines[name].model.phase_layers["decode"]

        def forward_linears() -> None:
            for lin in layers:
                lin.qkv(hidden), lin.o_proj(hidden), lin.gate_up(hidden), lin.down(inner)

        out[f"linears_m1_{name}_ms"] = 1e3 * _time_call(forward_linears, 9)
    int4 = weight_format("int4", 128)
    sw = int4.quantize(layer.gate_up.weight)  # [2 * intermediate, hidden]
    lin = int4.linear(sw, None, torch.float32)  # what serving runs here (the C kernel where it pays)
    x = torch.randn(1, layer.gate_up.weight.shape[1])
    out["int4_gate_up_m1_ms"] = 1e3 * _time_call(lambda: lin(x), 20)
    t = sw.tensors  # torch's INT4 GEMM, on bf16 and on float32 activations
    op = Int4Linear(t["qweight"], t["scales"], t["zeros"], 128, sw.shape[1], c_kernel=False)
    out["int4_gate_up_m1_bf16_act_ms"] = 1e3 * _time_call(lambda: op(x), 20)
    sz32 = op.scales_and_zeros.float()
    out["int4_gate_up_m1_fp32_act_ms"] = 1e3 * _time_call(
        lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, op.packed, op.run_group, sz32), 5)
    fp8 = weight_format("fp8")
    stored = [fp8.quantize(lin_.weight) for lin_ in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
    per_layer = _time_call(lambda: [fp8.dequantize(s) for s in stored], 3)
    out["fp8_dequantize_all_layers_ms"] = 1e3 * per_layer * len(fp32.phase_layers["decode"])
    h = torch.randn(1, fp32.lm_head.weight.shape[1])
    lm_int4 = int4.linear(int4.quantize(fp32.lm_head.weight), None, torch.float32)
    out["lm_head_m1_fp32_ms"] = 1e3 * _time_call(lambda: fp32.lm_head(h), 20)
    out["lm_head_m1_int4_ms"] = 1e3 * _time_call(lambda: lm_int4(h), 20)
    return out
