"""The decode GEMV of INT4 linear layers on CPUs with AVX512-BF16 or AVX2 (C, built on first use).

`kernels/cpu/gemv_int4.c` computes y = x . W^T for bfloat16 x [M, K] and an INT4 group-wise W
(`backend/weight_formats.py`: W = (q - 8) * s + z per group of columns) without dequantising it:
the 4-bit codes enter `vdpbf16ps` as the bfloat16 values 128 + q, and each group's sum is scaled
once, s * sum((128 + q) x) + (z - 136 s) * sum(x). The products are exact and the sums float32,
so the result is torch's INT4 GEMM (weights widened to float32) up to summation order; the C
file's header bounds what the cancellation of the 136 s term leaves (~2^-14 of the output at
worst, under the result's bfloat16 rounding).

The weights are repacked once at load (`pack`) into panels of 16 output rows, each one
contiguous stream: 0.5 bytes a weight plus a bfloat16 scale and zero per row and group, the
stored format's size. torch's `_weight_int4pack_mm_for_cpu` widens every weight to float32 for
every row of x: at SmolLM2's shapes one thread took twice the bfloat16 GEMV's time at 8 rows and
2.3x at 32 (`BENCHMARKS.md` has this kernel's figures against it).

Threads: as `cpu_gemv.py` (the shared pool, chunks of panels claimed one at a time; one thread
below `_THREADED_BYTES` of weights times x rows, `_SHARED_THREADED_BYTES` outside a decode step's
handover of torch's threads: a prompt's many rows make even a small weight worth sharing).
The build needs AVX512-BF16, AVX-512F (`kernels/cpu/gemv_int4_avx512f.h`: the same sums in float32 FMAs
on 16 lanes, the codes as the float32 values 128 + q, on the same layout) or AVX2 with FMA
(`kernels/cpu/gemv_int4_avx2.h`: the same on 8 lanes): elsewhere it fails, `available()` is False and
`Int4Linear` keeps torch's INT4 GEMM. Where it builds, `pays()` times it against torch's op once per process
(cores differ in how fast they run `vdpbf16ps`: an Intel Xeon VM measured ran it at 0.6 the rate of float32
FMAs, which torch's op uses) and `Int4Linear` takes the faster; `EDGESERVE_INT4_GEMV=0|1` forces the choice.

On CPUs with AMX, where the bfloat16 GEMV runs its AMX tiles (`cpu_gemv.tile_mode()`), calls of more than a few
rows run AMX tiles here too (`amx_code`): the expanded codes of 32 columns of a panel are one tile of
`tdpbf16ps`'s second operand, x rows the first as they lie; the same sums per group.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import time
from typing import NamedTuple

import torch

from kernels.cpu_build import CKernel
from kernels.cpu_threads import kernel_threads, kernels_own_threads

__all__ = ["KERNEL", "available", "build_error", "call_plan", "amx_code", "AMX_MIN_ROWS", "Int4Panels", "pack",
           "gemv_int4", "PANEL", "measure", "pays"]

log = logging.getLogger(__name__)

PANEL = 16  # output rows per panel (the C file's PANEL)
AMX_MIN_ROWS = 3  # rows past which AMX tiles take a call where the bf16 GEMV runs them (the C file's AMX_MIN_ROWS)
_THREADED_BYTES = 128 << 10  # packed weights below this run on the calling thread alone
_SHARED_THREADED_BYTES = 16 << 20  # the same while torch's OpenMP workers may spin (outside a handover)
_CHUNK_BYTES = 64 << 10  # of packed weights per chunk the threads claim


def _declare(lib: ctypes.CDLL) -> None:
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.gemv_int4.argtypes = [p, p, p, p, i, i, i, i, i, i, i]
    lib.gemv_int4.restype = ctypes.c_int


KERNEL = CKernel("gemv_int4.c", (), _declare, "INT4 linears run torch's INT4 GEMM", uses_pool=True)

available = KERNEL.available  # whether it builds and loads here (builds it on the first call)
build_error = KERNEL.build_error  # why not, or None


_PROBE = ((1, 16), 576, 1536, 32)  # rows, in_features, out_features, group size of the timed calls


def measure(reps: int = 5) -> dict[str, float]:
    """Seconds of the `_PROBE` calls (one at each row count) on one thread for this kernel ("c") and torch's
    INT4 GEMM ("torch"): the fastest of `reps` interleaved runs on fresh random operands."""
    rows, k, n, group = _PROBE
    codes = torch.randint(0, 16, (n, k), dtype=torch.int32)
    scales = (torch.rand(n, k // group) * 0.01 + 1e-3).to(torch.bfloat16)
    zeros = (torch.randn(n, k // group) * 0.01).to(torch.bfloat16)
    packed = pack(codes, scales, zeros, group)
    torch_packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    szs = torch.stack([scales.t(), zeros.t()], dim=-1).contiguous()  # the op's [groups, N, 2]
    xs = [torch.randn(m, k).to(torch.bfloat16) for m in rows]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        calls = {"c": lambda x: gemv_int4(x, packed, 1),
                 "torch": lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, torch_packed, group, szs)}
        best = dict.fromkeys(calls, float("inf"))
        for name, call in calls.items():  # warm
            for x in xs:
                call(x)
        for _ in range(reps):
            for name, call in calls.items():
                t = time.perf_counter()
                for x in xs:
                    call(x)
                best[name] = min(best[name], time.perf_counter() - t)
    finally:
        torch.set_num_threads(threads)
    return best


def pays() -> bool:
    """Whether `Int4Linear` runs this kernel here: it builds, and it beats torch's INT4 GEMM on the timed
    probe (once per process; `EDGESERVE_INT4_GEMV=1` forces it where it builds, `=0` keeps torch's op)."""
    forced = os.environ.get("EDGESERVE_INT4_GEMV", "auto")
    if forced == "0" or not available():
        return False
    return forced == "1" or _faster_than_torch()


@functools.lru_cache(maxsize=1)
def _faster_than_torch() -> bool:
    times = measure()
    faster = times["c"] < times["torch"]
    log.info("INT4 linears: %s (C kernel %.3f ms, torch's INT4 GEMM %.3f ms, rows %s)",
             "C kernel" if faster else "torch's INT4 GEMM", times["c"] * 1e3, times["torch"] * 1e3, _PROBE[0])
    return faster


class Int4Panels(NamedTuple):
    """An INT4 weight in the kernel's layout (the C file's header)."""

    codes: torch.Tensor  # uint8 [P, K8 / 8 * 64]: 16 rows by 8 columns per 64 bytes
    scales_zeros: torch.Tensor  # bfloat16 [P, G, 2, 16]
    out_features: int  # N (the panels hold P * 16 >= N rows)
    in_features: int  # K
    group_size: int

    @property
    def k8(self) -> int:
        """K rounded up to a multiple of 8 (the kernel's column step; x is zero-padded to it)."""
        return -(-self.in_features // 8) * 8

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scales_zeros.numel() * 2


def pack(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> Int4Panels:
    """codes [N, K] (integers 0..15), scales and zeros [N, ceil(K / g)] -> the kernel's layout. Rows past N
    (to whole panels) get zero scales and zeros, so they compute 0 and are never stored; columns past K (to
    a multiple of 8) get code 8 and meet x's zero padding."""
    if group_size % 8:
        raise ValueError(f"group size {group_size} is not a multiple of 8")
    n, k = codes.shape
    groups = -(-k // group_size)
    if scales.shape != (n, groups) or zeros.shape != (n, groups):
        raise ValueError(f"scales/zeros {list(scales.shape)}/{list(zeros.shape)} do not match [{n}, {groups}]")
    panels, k8 = -(-n // PANEL), -(-k // 8) * 8
    c = torch.full((panels * PANEL, k8), 8, dtype=torch.int16)
    c[:n, :k] = codes.to(torch.int16)
    c = c.view(panels, PANEL, k8 // 8, 4, 2).permute(0, 2, 1, 4, 3)  # [P, K8/8, 16 rows, column, nibble]
    words = c[..., 0] | (c[..., 1] << 4) | (c[..., 2] << 8) | (c[..., 3] << 12)  # int16: bit 15 wraps, as packed
    packed = words.contiguous().view(torch.uint8).view(panels, -1)
    sz = torch.zeros(panels * PANEL, groups, 2, dtype=torch.bfloat16)
    sz[:n, :, 0], sz[:n, :, 1] = scales.to(torch.bfloat16), zeros.to(torch.bfloat16)
    sz = sz.view(panels, PANEL, groups, 2).permute(0, 2, 3, 1).contiguous()
    return Int4Panels(packed, sz, n, k, group_size)


def amx_code(m: int, tiles: str | None = None) -> int:
    """1 where a call of m rows runs the C file's AMX tiles: the bfloat16 GEMV's per-process tile choice
    (`cpu_gemv.tile_mode()`, or `tiles`) is AMX, whose tile state it had Linux grant, and m is past
    AMX_MIN_ROWS (the C file checks K and the group)."""
    from kernels import cpu_gemv

    return int(m > AMX_MIN_ROWS and cpu_gemv.amx_available() and (tiles or cpu_gemv.tile_mode()) == "amx")


def gemv_int4(x: torch.Tensor, w: Int4Panels, threads: int | None = None, tiles: str | None = None) -> torch.Tensor:
    """x [M, K] bfloat16 (CPU) . W^T -> [M, N] bfloat16, W packed by `pack` (`available()` first). `tiles`:
    "amx" or another tile mode of `cpu_gemv` (default: its `tile_mode()`), whether the AMX tiles run."""
    if x.dim() != 2 or x.shape[1] != w.in_features or x.dtype != torch.bfloat16 or not x.is_cpu:
        raise ValueError(f"INT4 GEMV: x {x.dtype} {list(x.shape)} on {x.device} is not bfloat16 [M, "
                         f"{w.in_features}] on the CPU")
    lib = KERNEL.load()
    m = x.shape[0]
    n, k8 = w.out_features, w.k8
    y = torch.empty(m, n, dtype=torch.bfloat16)
    if m == 0 or n == 0:
        return y
    x = x.contiguous() if x.shape[1] == k8 else torch.nn.functional.pad(x, (0, k8 - x.shape[1])).contiguous()
    threads, chunks = call_plan(m, w, threads)
    if lib.gemv_int4(x.data_ptr(), w.codes.data_ptr(), w.scales_zeros.data_ptr(), y.data_ptr(), m, n, k8,
                     w.group_size, threads, chunks, amx_code(m, tiles)) != 0:
        raise MemoryError(f"INT4 GEMV: no memory for the group sums of a [{m}, {k8}] input")
    return y


def call_plan(m: int, w: Int4Panels, threads: int | None = None) -> tuple[int, int]:
    """(threads, chunks) of a call with m rows of x: the threads by the work, the weights' bytes once per x row
    (`threads` if given; a prompt's rows share any weight), chunks of about `_CHUNK_BYTES`. `gemv_int4` and
    the fused decode layers (`cpu_decode_layers`) split alike."""
    nbytes = w.codes.numel()
    if threads is None:
        floor = _THREADED_BYTES if kernels_own_threads() else _SHARED_THREADED_BYTES
        threads = kernel_threads() if nbytes * m >= floor else 1
    return threads, max(threads, nbytes // _CHUNK_BYTES) if threads > 1 else 1
