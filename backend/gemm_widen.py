"""Bfloat16 GEMMs of many rows, run in float32 where this CPU's float32 GEMM is the faster one.

A prefill step multiplies hundreds of rows by every weight: compute-bound, so what
counts is the GEMM rate. With bfloat16 weights torch runs oneDNN's bfloat16 GEMM,
which on a CPU with AVX512-BF16 but no AMX uses `vdpbf16ps`. Whether that beats
float32 depends on the core: on an Intel Xeon (Emerald Rapids) VM whose AMX is not
exposed, `vdpbf16ps` retires ~0.6 per cycle, 75 GFLOP/s a core, against 123 for float32
FMAs (a C loop of independent accumulators fed from L1), so a 512-row bfloat16 GEMM
ran at 146 GFLOP/s against 247 in float32, and a 512-token prefill step spent 82% of
its 860 ms in `aten::mm`. On an AMD EPYC (Zen 4) bfloat16 was the faster one. So it
is measured, not read off the flags.

Widening: y = (x in float32) @ (W in float32).T, rounded to x's dtype. bfloat16
values are exact in float32, so every product is exact and the sums are float32
sums, as in oneDNN's bfloat16 GEMM (which accumulates in float32 too); only the
summation order differs. The float32 copy of W is made per call and dropped: it
costs one read of W and a write of twice its bytes, against a GEMM of 2 * rows * |W|
flops, so it pays only from about 128 rows (measured, 576 x 1536 weight, 2 threads:
bfloat16 / widened time 0.92 at 32 rows, 1.10 at 64, 1.34 at 128, 1.87 at 512).
No weight is held twice.

`widening_pays()` times both on one 256-row GEMM, interleaved, once per process on
the thread that first asks (the engine thread, with its own torch thread count),
and says yes when widening is at least `_MARGIN` faster. `EDGESERVE_BF16_WIDEN=0`
or `=1` skips the measurement and forces the answer.
"""

from __future__ import annotations

import functools
import logging
import os
import time

import torch

__all__ = ["WIDEN_MIN_ROWS", "widening_pays", "widened_linear", "measure_widening"]

log = logging.getLogger(__name__)

WIDEN_MIN_ROWS = 128  # below this the per-call float32 copy of the weight costs more than it saves
_MARGIN = 1.15  # widen only when the measured float32 path is at least this much faster
_PROBE_SHAPE = (256, 1024, 1024)  # rows, in_features, out_features of the timed GEMM


def widened_linear(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [T, K] @ weight_t [K, N] (+ bias) computed in float32, returned in x's dtype."""
    x32, w32 = x.float(), weight_t.float()
    y = torch.mm(x32, w32) if bias is None else torch.addmm(bias.float(), x32, w32)
    return y.to(x.dtype)


def measure_widening(reps: int = 5) -> tuple[float, float]:
    """(bfloat16 GEMM seconds, widened seconds): the fastest of `reps` interleaved runs each on
    a `_PROBE_SHAPE` GEMM with fresh random operands, at the calling thread's torch threads."""
    rows, k, n = _PROBE_SHAPE
    x = torch.randn(rows, k).to(torch.bfloat16)
    w_t = torch.randn(n, k).to(torch.bfloat16).t()
    best = [float("inf"), float("inf")]
    runs = (lambda: torch.mm(x, w_t), lambda: widened_linear(x, w_t, None))
    for f in runs:  # warm both paths (oneDNN primitive creation, allocator)
        f()
    for _ in range(reps):
        for i, f in enumerate(runs):
            t = time.perf_counter()
            f()
            best[i] = min(best[i], time.perf_counter() - t)
    return best[0], best[1]


@functools.lru_cache(maxsize=1)
def widening_pays() -> bool:
    """Whether bfloat16 GEMMs of >= WIDEN_MIN_ROWS rows should run widened to float32 on this CPU
    (measured once per process; `EDGESERVE_BF16_WIDEN=0|1` forces the answer)."""
    forced = os.environ.get("EDGESERVE_BF16_WIDEN", "auto")
    if forced in ("0", "1"):
        return forced == "1"
    bf16_s, widened_s = measure_widening()
    pays = bf16_s >= _MARGIN * widened_s
    log.info("bf16 GEMM widening %s: bfloat16 %.2f ms, float32 widened %.2f ms (%s rows)",
             "on" if pays else "off", bf16_s * 1e3, widened_s * 1e3, _PROBE_SHAPE[0])
    return pays
