"""The runtime GEMM objects of linear layers: dense (MKL-packed float32 buckets), INT4, FP8.

Every object is called as ``y = linear(x)`` with x [T, in_features] in the compute
dtype and returns y [T, out_features] in the same dtype; `nbytes` is what it holds.
Which one a weight gets is decided by its format (`backend/weight_formats.py`).

Dense weights (`Linear`) run a GEMM in the weight's dtype (activations are cast to
it and back when the compute dtype differs); the rest of this docstring is about
float32 weights on CPU.

Why buckets: on this class of CPU (AVX-512 without BF16 units) a float32 GEMM with a
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

Bfloat16 weights on a CPU with AVX512-BF16, or AVX2 and FMA: calls of at most `cpu_gemv.max_rows()`
rows (a decode step's requests, and a short prompt chunk where the CPU's tiles are fast) run the C
kernel of `kernels/cpu_gemv.py`, which reads the weight at close to the memory's rate where torch's
bfloat16 GEMM reached about half of it (where it is emulated, without BF16 units, far less); same
products, float32 sums in another order, rounded to bfloat16 as torch's result is. Calls of at least
`gemm_widen.WIDEN_MIN_ROWS` rows (prefill) run in float32 on a float32 copy of the weight made per call,
where this CPU's float32 GEMM measured faster (`backend/gemm_widen.py`).

Float32 weights likewise run the float32 C GEMV (`kernels/cpu_gemv_f32.py`) for calls of at most
`cpu_gemv_f32.max_rows()` rows where it builds; larger calls keep the MKL paths above. `gemv_rows` says
up to how many rows a linear's C GEMV runs (0: none), so that the engine hands those steps' threads to
the C kernels and the decoder layers may run them in one C call (`backend/layers/fused_decode.py`).
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Protocol

import torch

from backend import gemm_pack
from backend.gemm_widen import WIDEN_MIN_ROWS, widened_linear, widening_pays
from kernels import cpu_gemv, cpu_gemv_f32  # builds nothing at import (the C build runs on first use)

__all__ = ["LinearOp", "Linear", "Int4Linear", "Fp8Linear", "bf16_gemv_available", "f32_gemv_available",
           "mkl_packing_available",
           "DEFAULT_BUCKETS"]

DEFAULT_BUCKETS: tuple[int, ...] = (8, 32, 128)
_UNPACKED_MAX_ROWS = 4
_UNPACKED_MIN_ROWS = 256  # large prefill batches: plain GEMM is compute-bound anyway, and saves chunk copies


class LinearOp(Protocol):
    """What the model calls: y [T, out_features] = linear(x [T, in_features]), compute dtype in and out."""

    out_features: int
    nbytes: int  # bytes of weight data held (MKL packs excluded)

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


def bf16_gemv_available() -> bool:
    """Whether the bfloat16 decode GEMV (AVX512-BF16, or its AVX2 copy) is built for this CPU
    (`EDGESERVE_BF16_GEMV=0` turns it off)."""
    import os

    if os.environ.get("EDGESERVE_BF16_GEMV", "1") == "0":
        return False
    return cpu_gemv.available()


def f32_gemv_available() -> bool:
    """Whether the float32 decode GEMV is built for this CPU (`EDGESERVE_F32_GEMV=0` turns it off)."""
    if os.environ.get("EDGESERVE_F32_GEMV", "1") == "0":
        return False
    return cpu_gemv_f32.available()


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
        cpu = weight.device.type == "cpu" and weight.is_contiguous()
        self.gemv = cpu and ((weight.dtype == torch.bfloat16 and bf16_gemv_available())
                             or (weight.dtype == torch.float32 and f32_gemv_available()))
        self.widen = weight.dtype == torch.bfloat16 and weight.device.type == "cpu"  # if widening_pays()
        self.packed: torch.Tensor | None = None  # the weight packed for oneDNN (backend/gemm_pack.py), made lazily
        self.pack_tried = not self.widen  # bfloat16 CPU weights only

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes of the weight (one copy; packs excluded)."""
        return self.weight.numel() * self.weight.element_size()

    @property
    def pack_bytes(self) -> int:
        """Bytes of the MKL packs (~1.3x the weight per bucket; MKL sizes a pack in bytes and torch
        allocates that many float32 elements, so only the first quarter is written and resident: the
        pack's bytes are its numel) and of the oneDNN pack (the weight's bytes again)."""
        return sum(p.numel() for p in self.packs.values()) + (self.weight.nbytes if self.packed is not None else 0)

    def pack_now(self) -> None:
        """Make the oneDNN pack of a bfloat16 weight now (within the budget), not at the first call that takes it."""
        if not self.pack_tried:
            self.pack_tried = True
            self.packed = gemm_pack.pack(self.weight, self)

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        """The GEMM without MKL's packs: from the oneDNN pack of a bfloat16 weight (`backend/gemm_pack.py`,
        made at the first call of enough rows, within the process's budget), else from the weight as it lies."""
        if x.dtype == torch.bfloat16 and gemm_pack.takes(x.shape[0]):
            self.pack_now()
            if self.packed is not None:
                return gemm_pack.packed_linear(x, self.packed, self.bias)
        if self.bias is None:
            return torch.mm(x, self.weight_t)
        return torch.addmm(self.bias, x, self.weight_t)

    @property
    def gemv_rows(self) -> int:
        """Rows up to which a call runs the C GEMV of the weight's dtype (0: none)."""
        if not self.gemv:
            return 0
        return cpu_gemv_f32.max_rows() if self.weight.dtype == torch.float32 else cpu_gemv.max_rows()

    def takes_gemv(self, rows: int) -> bool:
        """Whether a call of `rows` rows runs the C GEMV (`kernels/cpu_gemv.py`, `kernels/cpu_gemv_f32.py`)."""
        return self.gemv and rows <= self.gemv_rows and not self.widens(rows)

    def widens(self, rows: int) -> bool:
        """Whether a call of `rows` rows runs widened to float32 (`backend/gemm_widen.py`)."""
        return self.widen and rows >= WIDEN_MIN_ROWS and widening_pays()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.widens(rows):
            return widened_linear(x, self.weight_t, self.bias)
        if x.dtype != self.weight.dtype:  # e.g. bf16 weights under float32 compute
            return self(x.to(self.weight.dtype)).to(x.dtype)
        if self.gemv and rows <= self.gemv_rows:
            y = (cpu_gemv_f32.gemv_f32 if self.weight.dtype == torch.float32 else cpu_gemv.gemv_bf16)(x, self.weight)
            return y if self.bias is None else y.add_(self.bias)
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


def _int4_gemv_available(group_size: int) -> bool:
    """Whether Int4Linear runs the C kernel: it takes this group size, builds for this CPU and beats torch's
    INT4 GEMM here (`cpu_gemv_int4.pays`: timed once per process; `EDGESERVE_INT4_GEMV=0|1` forces it)."""
    if group_size % 8:
        return False
    from kernels.cpu_gemv_int4 import pays

    return pays()


class Int4Linear:
    """y = x @ W.T + bias for an INT4 group-wise weight (layout in `weight_formats.py`).

    CPU with AVX512-BF16 or AVX2, where it beat torch's op on a timed probe: the C kernel of
    `kernels/cpu_gemv_int4.py` at every row count, on
    the weight repacked once at load into its panels (the stored format's size): the codes
    enter `vdpbf16ps` (AVX2: float32 FMAs) as they are and each group's sum is scaled once,
    about half the time of torch's INT4 GEMM from 1 to 1,024 rows on SmolLM2's shapes
    (`BENCHMARKS.md`; 0.54-0.71x at 1-32 rows on an AVX2 host).
    Elsewhere `torch.ops.aten._weight_int4pack_mm_for_cpu` on bfloat16 activations (its fast
    path; float32 activations run 20-40x slower there). Either way x is cast to bfloat16
    and y back. torch's op wants K in whole groups and N a multiple of 16. A group of g
    columns is run as g / r groups of r with the same scale and zero, r the largest power of
    two <= g dividing K (>= 32; SmolLM2's K = 576 at g = 128 runs r = 64): the same numbers
    with no per-call padding of x. Otherwise K is padded with zero columns per call; N is
    padded with zero rows at load and y cut back.
    CUDA: the Triton W4A16 kernel on the stored layout, in x's dtype.
    """

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                 in_features: int, bias: torch.Tensor | None = None, c_kernel: bool | None = None) -> None:
        """`c_kernel`: None runs the C kernel where it builds and pays (`_int4_gemv_available`), False torch's
        op (a benchmark's comparison)."""
        self.group_size = group_size
        self.in_features = in_features
        self.out_features = qweight.shape[0]
        self.bias = bias
        self.cuda = qweight.device.type == "cuda"
        self.panels = None  # the C kernel's layout, when it runs
        self.gemv = False  # every row count runs the C kernel (the engine then hands it torch's threads)
        if self.cuda:
            self.qweight, self.scales, self.zeros = qweight.contiguous(), scales.contiguous(), zeros.contiguous()
            self.nbytes = sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.zeros))
            return
        from kernels.w4a16_gemm import unpack_int4_ref

        codes = unpack_int4_ref(qweight)[:, :in_features]
        if c_kernel is not False and _int4_gemv_available(group_size):
            from kernels.cpu_gemv_int4 import pack

            self.panels = pack(codes, scales, zeros, group_size)
            self.gemv = True
            self.nbytes = self.panels.nbytes
            return
        n = qweight.shape[0]
        run_group = group_size
        while in_features % run_group and run_group > 32:
            run_group //= 2
        if in_features % run_group:
            run_group = group_size  # pad K per call
        self.run_group = run_group
        split = group_size // run_group  # runtime groups per stored group
        groups = -(-in_features // run_group)
        self.k_padded = groups * run_group
        n_padded = -(-n // 16) * 16
        padded = torch.full((n_padded, self.k_padded), 8, dtype=torch.int32)  # code 8 with zero scale: 0
        padded[:n, :in_features] = codes
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(padded, 1)  # [N', K'/2] uint8
        scales_and_zeros = torch.zeros(groups, n_padded, 2, dtype=torch.bfloat16)  # the op's [groups, N, 2]
        scales_and_zeros[:, :n, 0] = scales.t().to(torch.bfloat16).repeat_interleave(split, dim=0)[:groups]
        scales_and_zeros[:, :n, 1] = zeros.t().to(torch.bfloat16).repeat_interleave(split, dim=0)[:groups]
        self.scales_and_zeros = scales_and_zeros
        self.nbytes = self.packed.numel() + scales_and_zeros.numel() * 2

    @property
    def gemv_rows(self) -> int:
        """Rows up to which the engine hands a step's threads to the C kernels for this linear (its C kernel takes
        every count; the bfloat16 GEMV's limit keeps the rest of the step in C too), 0 without the C kernel."""
        return cpu_gemv.max_rows() if self.gemv else 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.cuda:
            from kernels.w4a16_gemm import w4a16_gemm

            y = w4a16_gemm(x.contiguous(), self.qweight, self.scales, self.zeros, self.group_size)
        elif self.panels is not None:
            from kernels.cpu_gemv_int4 import gemv_int4

            y = gemv_int4(x.to(torch.bfloat16), self.panels).to(x.dtype)
        else:
            xb = x.to(torch.bfloat16)
            if self.k_padded != self.in_features:
                xb = torch.nn.functional.pad(xb, (0, self.k_padded - self.in_features))
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.packed, self.run_group, self.scales_and_zeros)
            if y.shape[1] != self.out_features:
                y = y[:, : self.out_features]
            y = y.to(x.dtype)
        return y if self.bias is None else y.add_(self.bias)


class Fp8Linear:
    """y = x @ W.T + bias for an FP8 weight with per-row block scales, through the Triton
    W8A16 kernel (CUDA only: on CPU the FP8 format dequantises at load into a `Linear`)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, block_k: int,
                 bias: torch.Tensor | None = None) -> None:
        self.weight = weight  # [N, K] float8_e4m3fn
        self.scale = scale  # [N, ceil(K / block_k)] float32
        self.block = (1, block_k)
        self.bias = bias
        self.out_features = weight.shape[0]
        self.nbytes = weight.numel() + scale.numel() * 4

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from kernels.fp8_gemm import fp8_gemm

        y = fp8_gemm(x.contiguous(), self.weight, self.scale, self.block)
        return y if self.bias is None else y.add_(self.bias)
