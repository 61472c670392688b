"""Dense linear layers for the CPU runtime, with MKL-packed weights for small batches.

Why: on this class of CPU (AVX-512 without BF16 units) a float32 GEMM with a
small number of rows M (one decode step: M = running requests) over weights that
are not in cache runs far below the machine's rate, because MKL repacks the
weight on every call. MKL can pack a weight once for a given M
(`_mkl_reorder_linear_weight(w, M)`); `_mkl_linear` then runs ~2-3x faster, but
only for exactly that M (any other M silently takes the slow path).

So each weight is packed once per *bucket* size (default 8, 32, 128 rows). A
call with T rows is split into bucket-sized chunks (the last one zero-padded)
by the cheapest plan under a small cost model (a fixed cost per chunk plus a
per-row cost, fit on this CPU class); a chunk of <= 4 rows, where a plain GEMV
is already bandwidth-bound, goes through the plain GEMM, as do calls of 256 rows
or more (compute-bound: packing gains nothing there and chunking would add
copies). Results equal `F.linear` up to GEMM summation order.

Each bucket costs one extra copy of the weight in memory (for SmolLM2-135M in
float32: ~0.54 GB per bucket). Buckets are used only for float32 weights on a
CPU build with MKL; everything else uses the plain GEMM.
"""

from __future__ import annotations

from functools import lru_cache

import torch

__all__ = ["Linear", "mkl_packing_available", "DEFAULT_BUCKETS"]

DEFAULT_BUCKETS: tuple[int, ...] = (8, 32, 128)
_UNPACKED_MAX_ROWS = 4
_UNPACKED_MIN_ROWS = 256  # large prefill batches: plain GEMM is compute-bound anyway, and saves chunk copies


def mkl_packing_available() -> bool:
    """True when this torch build has MKL's packed-weight linear ops."""
    return bool(torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight"))


def _cost(bucket: int) -> float:
    """Relative time of one chunk: a fixed part plus a per-row part (fit on this CPU class)."""
    return 25.0 if bucket == 0 else 20.0 + 0.8 * bucket


@lru_cache(maxsize=4096)
def _plan(rows: int, buckets: tuple[int, ...]) -> tuple[tuple[int, int, int], ...]:
    """Cheapest split of `rows` into (start, length, bucket) chunks; bucket 0 = unpacked F.linear."""
    best: list[tuple[float, int]] = [(0.0, 0)] * (rows + 1)  # best[r] = (cost, bucket of the first chunk)
    for r in range(1, rows + 1):
        options = [(_cost(b) + best[max(0, r - b)][0], b) for b in buckets]
        if r <= _UNPACKED_MAX_ROWS:
            options.append((_cost(0), 0))
        best[r] = min(options)
    plan, start, r = [], 0, rows
    while r > 0:
        bucket = best[r][1]
        length = r if bucket == 0 else min(bucket, r)
        plan.append((start, length, bucket))
        start, r = start + length, r - length
    return tuple(plan)


class Linear:
    """y = x @ weight.T + bias, dispatched to MKL-packed weights by row count."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 buckets: tuple[int, ...] = ()) -> None:
        self.weight = weight  # [out_features, in_features]
        self.weight_t = weight.t()  # a view: mm(x, weight_t) skips linear's transpose dispatch
        self.bias = bias
        use = bool(buckets) and weight.dtype == torch.float32 and weight.device.type == "cpu" \
            and mkl_packing_available()
        self.buckets = tuple(sorted(buckets)) if use else ()
        self.packs = {b: torch.ops.mkl._mkl_reorder_linear_weight(weight, b) for b in self.buckets}

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes of the weight (one copy; packs excluded)."""
        return self.weight.numel() * self.weight.element_size()

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        """The unpacked GEMM."""
        if self.bias is None:
            return torch.mm(x, self.weight_t)
        return torch.addmm(self.bias, x, self.weight_t)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if not self.buckets or rows <= _UNPACKED_MAX_ROWS or rows >= _UNPACKED_MIN_ROWS:
            return self._dense(x)
        plan = _plan(rows, self.buckets)
        if len(plan) == 1 and plan[0][1] == plan[0][2]:
            return torch.ops.mkl._mkl_linear(x, self.packs[plan[0][2]], self.weight, self.bias, plan[0][2])
        out = x.new_empty(rows, self.out_features)
        for start, length, bucket in plan:
            part = x[start: start + length]
            if bucket == 0:
                out[start: start + length] = self._dense(part)
                continue
            if length < bucket:
                padded = x.new_zeros(bucket, x.shape[1])
                padded[:length] = part
                part = padded
            y = torch.ops.mkl._mkl_linear(part.contiguous(), self.packs[bucket], self.weight, self.bias, bucket)
            out[start: start + length] = y[:length]
        return out
