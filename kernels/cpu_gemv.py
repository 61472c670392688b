"""The decode GEMV of bfloat16 linear layers on CPUs with AVX512-BF16 (C, built on first use).

`kernels/cpu/gemv_bf16.c` computes y = x . W^T for bfloat16 x [M, K] and W [N, K] with
`vdpbf16ps` (exact bfloat16 products, float32 sums), reading the weights once at close to
the memory's rate. It is used for the few rows of a decode step (`MAX_ROWS`), where a GEMV is
bound by reading the weights and torch's bfloat16 GEMM ran at about half that rate (measured
with `edgeserve bench token-profile`).
The result is rounded to bfloat16, as torch's bfloat16 GEMM returns it; it differs from
torch's only in summation order.

Threads: `torch.get_num_threads()`, in an OpenMP region on torch's own worker pool (the C file
says how and what it measured: on a 2-core VM two threads beat one at every SmolLM2 layer size,
where a pthread per call had lost at every size). The build needs AVX512-BF16 and OpenMP:
elsewhere it fails, `available()` is False and `Linear` keeps torch's GEMM.
"""

from __future__ import annotations

import ctypes

import torch

from kernels.cpu_build import CKernel

__all__ = ["available", "build_error", "gemv_bf16", "MAX_ROWS"]

# x rows (decode tokens) up to which Linear runs the kernel: over SmolLM2's linears (2-core Zen 4,
# 2 threads) it took 0.29x torch's bfloat16 GEMM's time at 1 row, 0.41x at 4, 0.68x at 8 and 0.79x
# at 16 (x rows in chunks of 8: the weights are read twice there)
MAX_ROWS = 16


def _declare(lib: ctypes.CDLL) -> None:
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.gemv_bf16.argtypes = [p, p, p, i, i, i, i]
    lib.gemv_bf16.restype = None


_KERNEL = CKernel("gemv_bf16.c", ("-fopenmp",), _declare, "bfloat16 decode GEMVs run torch's GEMM")


def available() -> bool:
    """Whether the kernel is built and loaded for this CPU (builds it on the first call)."""
    return _KERNEL.load() is not None


def build_error() -> str | None:
    """Why the kernel is unavailable, or None."""
    _KERNEL.load()
    return _KERNEL.error


def gemv_bf16(x: torch.Tensor, weight: torch.Tensor, threads: int | None = None) -> torch.Tensor:
    """x [M, K] . weight [N, K]^T -> [M, N] bfloat16, for contiguous bfloat16 CPU tensors and
    any M (x rows in chunks of 8; `Linear` calls it up to MAX_ROWS; `available()` first)."""
    lib = _KERNEL.load()
    m, k = x.shape
    n = weight.shape[0]
    x = x.contiguous()
    y = torch.empty(m, n, dtype=torch.float32)
    if threads is None:
        threads = torch.get_num_threads()
    lib.gemv_bf16(x.data_ptr(), weight.data_ptr(), y.data_ptr(), m, n, k, threads)
    return y.to(torch.bfloat16)
