"""The decode GEMV of float32 linear layers (C, built on first use): the float32 twin of `cpu_gemv`.

`kernels/cpu/gemv_f32.c` computes y = x . W^T for float32 x [M, K] and W [N, K] into float32 y [M, N]:
AVX-512F, or its AVX2 copy (`kernels/cpu/gemv_f32_avx2.h`), or plain C on other CPUs, whichever this host
builds. Up to 8 rows (6 on AVX2) it streams the weight rows once in memory order, prefetched ahead, every
weight vector multiplied with all x rows; past that it runs register tiles of 6 x rows by 4 weight rows of FMAs
(6 x 2 on AVX2, where from 12 rows K also runs in blocks of at most 768 columns so an x tile stays in L1) over
blocks of weight rows kept in L2 (the C files' headers have the layout and the measurements).

Numerics: float32 products and float32 sums (fused multiply-adds), as torch's float32 GEMM; only the summation
order differs, so a result is within a few float32 ulps of sum |x w| of torch's. Each output comes whole from
one thread's chunk: the thread and chunk counts change no bit.

Threads: as `cpu_gemv` (the shared pool; `call_plan` is `cpu_gemv.weight_plan` over the weights' bytes): the
caller and the pool's helpers claim chunks of weights, threaded only where the weights are large enough.

Measured on a 2-core Intel Xeon VM (AVX-512 with FP16 and AMX; the AVX-512F copy), SmolLM2-135M's decode
shapes, this function at 2 threads against `torch.nn.functional.linear` in float32 with torch at 2 threads,
blocks of 25 calls of each alternating for 600 calls each, medians; each call on the next of 48 MB of weight
copies (so from L3, not L2; this VM's L3 is larger than the model). us per call (GB/s of weights), kernel / torch:

    (N, K)        M = 1                      M = 8                      M = 32
    (960, 576)    45.7 (48.4) / 40.1 (55.1)  50.1 (44.1) / 82.2 (26.9)   133 (16.6) / 146 (15.2)
    (576, 576)    28.6 (46.4) / 24.9 (53.3)  31.7 (41.8) / 50.7 (26.2)  82.9 (16.0) / 91.3 (14.5)
    (3072, 576)    132 (53.8) /  120 (58.8)   149 (47.6) /  344 (20.6)   430 (16.5) / 501 (14.1)
    (576, 1536)   69.9 (50.6) / 63.0 (56.2)  96.5 (36.7) /  111 (31.9)   227 (15.6) / 303 (11.7)

At one row both read at the two cores' rate from L3 (the C call alone, without this wrapper's ~2 us of Python
over F.linear's, ran 0.98-1.06x torch's time there; one thread 28 GB/s for both); at 8 rows torch's float32 GEMM
falls to 20-32 GB/s where the kernel keeps 37-48; at 32 rows the tiles run 250-265 GFLOP/s on two cores
(130-150 on one). Alternating call by call instead, each side loses to the other's spinning threads (torch's
OpenMP workers spin after each call and share the cores with the pool's helpers): the kernel then ran 1.8-3.3x
torch's time at one row, which is why a decode step hands torch's threads over to the kernels
(`cpu_threads.torch_single_threaded`) rather than interleaving the two.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from backend.cpu_features import cpu_flags, has_avx2_only
from kernels import cpu_gemv
from kernels.cpu_build import CKernel

__all__ = ["KERNEL", "MAX_ROWS", "AVX2_MAX_ROWS", "PLAIN_MAX_ROWS", "SYMBOL", "address", "available", "build_error",
           "call_plan", "gemv_f32", "max_rows"]

# Rows up to which a caller should take the kernel over torch's float32 GEMM: measured with AVX-512 up to 32
# (0.75-0.91x torch's time there, the table above); past it unmeasured, so torch's GEMM. The AVX2 copy, on a
# 2-core AMD EPYC VM (Zen 3 flags, no AVX-512; `edgeserve bench cpu-kernels --sections linear_f32`, SmolLM2's
# 121 linears, torch/C time, its 6 x 2 tiles): 1.91x at 1 row, 2.33x at 8, 1.87x at 16, 1.51x at 32, 1.27x at 64,
# 1.09x at 128. A step within the limit also runs the fused decode layers, which is worth more than the GEMMs
# alone: there a 100-token prompt's step took 171-186 ms with the limit at 128 against 265-321 at 64, a decode step
# of 96 requests 211-230 against 325-384, and with the limit at 64 against 8 steps of 16 / 32 / 48 / 64 requests
# 55 / 97-101 / 142-146 / 184-191 ms against 151-168 / 149-158 / 274-287 / 266-290 (BENCHMARKS.md). The plain C
# copy (neither) is not measured: only the bandwidth-bound rows.
MAX_ROWS = 32
AVX2_MAX_ROWS = 128
PLAIN_MAX_ROWS = 8

SYMBOL = "gemv_f32"  # the C entry point: (x, w, y, M, N, K, threads, chunks) -> 0


def _declare(lib: ctypes.CDLL) -> None:
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.gemv_f32.argtypes = [p, p, p, i, i, i, i, i]
    lib.gemv_f32.restype = ctypes.c_int


KERNEL = CKernel("gemv_f32.c", (), _declare, "float32 decode GEMVs run torch's GEMM", uses_pool=True)


available = KERNEL.available  # whether it builds and loads here (builds it on the first call)
build_error = KERNEL.build_error  # why not, or None


def max_rows() -> int:
    """Rows up to which the kernel is the faster path on this CPU: `MAX_ROWS` with AVX-512, `AVX2_MAX_ROWS` with
    AVX2 and FMA (the ranges measured), `PLAIN_MAX_ROWS` for the plain C copy."""
    return _max_rows_for(cpu_flags())  # per Linear call on the Python layers' path: answered from a cache


@functools.lru_cache(maxsize=4)
def _max_rows_for(flags: frozenset[str]) -> int:
    if "avx512f" in flags:
        return MAX_ROWS
    return AVX2_MAX_ROWS if has_avx2_only(flags) else PLAIN_MAX_ROWS


def address() -> int | None:
    """The C entry point's address (for C code that calls it, like the fused decode layers), or None where the
    kernel is unavailable."""
    return KERNEL.address(SYMBOL)


def call_plan(m: int, n: int, k: int, threads: int | None = None) -> tuple[int, int, int]:
    """(threads, chunks, 0) of a call with x [m, k] and weight [n, k], in `cpu_gemv.call_plan`'s layout (whose
    third element, the FMA-tile flag, has no meaning here): `cpu_gemv.weight_plan` over the weights' bytes."""
    return (*cpu_gemv.weight_plan(n * k * 4, threads), 0)


def _reject(x: torch.Tensor, weight: torch.Tensor) -> None:
    """Raise ValueError naming what is wrong with the arguments (called only when the fast check failed)."""
    for name, t in (("x", x), ("weight", weight)):
        if t.dtype != torch.float32:
            raise ValueError(f"float32 GEMV: {name} is {t.dtype}, not torch.float32")
        if t.dim() != 2:
            raise ValueError(f"float32 GEMV: {name} has shape {tuple(t.shape)}, not 2-D")
        if t.device.type != "cpu":
            raise ValueError(f"float32 GEMV: {name} is on {t.device}, not the CPU")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"float32 GEMV: x {tuple(x.shape)} and weight {tuple(weight.shape)} differ in K")
    raise ValueError(f"float32 GEMV: weight (strides {weight.stride()}) is not contiguous")


def gemv_f32(x: torch.Tensor, weight: torch.Tensor, threads: int | None = None,
             chunks: int | None = None) -> torch.Tensor:
    """x [M, K] . weight [N, K]^T -> [M, N] float32, for float32 CPU tensors, a contiguous weight and any M
    (x is copied if strided); `available()` first. `threads` and `chunks` override `call_plan`'s. Raises
    ValueError on another dtype, shape or layout."""
    if not (x.dtype == weight.dtype == torch.float32 and x.dim() == weight.dim() == 2 and x.is_cpu
            and weight.is_cpu and x.shape[1] == weight.shape[1] and weight.is_contiguous()):
        _reject(x, weight)  # one test on the path of every call (a decode step makes hundreds)
    lib = KERNEL.load()
    if lib is None:
        raise RuntimeError(f"float32 GEMV unavailable: {KERNEL.error}")
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    if m == 0 or n == 0:
        return y
    x = x.contiguous()
    plan_threads, plan_chunks, _ = call_plan(m, n, k, threads)
    if lib.gemv_f32(x.data_ptr(), weight.data_ptr(), y.data_ptr(), m, n, k, plan_threads,
                    plan_chunks if chunks is None else chunks) != 0:
        raise RuntimeError(f"float32 GEMV failed on x [{m}, {k}], weight [{n}, {k}]")
    return y
