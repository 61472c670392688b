"""Rotary position embedding of bfloat16 heads in one C call (`kernels/cpu/rope_bf16.c`, built on first use).

`backend/rope.py` rotates interleaved pairs with a complex product in float32: widen the (strided) query and
key heads, multiply by the per-token rotations, narrow to bfloat16, three passes and their dispatch per layer.
The kernel does the same arithmetic in one pass (its header gives the rounding and the measured cost) and
returns None where it cannot run (no C compiler, not bfloat16 heads on the CPU, heads not contiguous within a
token), so the caller keeps its torch path.
Rows of a large call (a prompt chunk's) are shared out in contiguous runs (`pool_rows` in `kernels/cpu/pool.h`),
on the C kernels' helper pool or torch's OpenMP pool (`cpu_threads.run_mode`); a row's arithmetic does not change.
"""

from __future__ import annotations

import ctypes

import torch

from kernels.cpu_build import CKernel
from kernels.cpu_threads import kernel_threads, run_mode

__all__ = ["KERNEL", "available", "build_error", "rope_bf16"]


def _declare(lib: ctypes.CDLL) -> None:
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.rope_bf16.argtypes = [p, p, p, i, i, i, i, ctypes.c_int64, i, i]
    lib.rope_bf16.restype = None


KERNEL = CKernel("rope_bf16.c", ("-fno-math-errno",), _declare, "rotary embedding runs its torch ops",
                  uses_pool=True)


available = KERNEL.available  # whether it builds and loads here (builds it on the first call)
build_error = KERNEL.build_error  # why not, or None


def rope_bf16(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor | None:
    """x [T, heads, head_dim] (bfloat16, CPU; tokens may be strided, each token's heads contiguous) with its
    first 2P dims of every head rotated as interleaved pairs by freqs [T, 1, P] (complex64, `RotaryEmbedding.
    tables`), the rest copied: a new contiguous tensor, or None when the kernel cannot run this case."""
    rows, heads, dim = x.shape
    pairs = freqs.shape[-1]
    if (x.dtype != torch.bfloat16 or not x.is_cpu or freqs.dtype != torch.complex64
            or x.stride(2) != 1 or x.stride(1) != dim or freqs.numel() != rows * pairs or 2 * pairs > dim
            or not freqs.is_contiguous()):
        return None
    lib = KERNEL.load()
    if lib is None:
        return None
    y = torch.empty(rows, heads, dim, dtype=torch.bfloat16)
    if rows and heads:  # complex64 is (cos, sin) float pairs in memory
        lib.rope_bf16(x.data_ptr(), freqs.data_ptr(), y.data_ptr(), rows, heads, dim, pairs, x.stride(0),
                      kernel_threads(), run_mode())
    return y
