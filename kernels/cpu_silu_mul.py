"""SwiGLU's `silu(gate) * up` of bfloat16 rows in one C call (`kernels/cpu/silu_mul_bf16.c`, built on first use).

`backend/layers/mlp.py` splits the fused gate/up projection's output [T, 2I] and computes
`F.silu(gate).mul_(up)`: two torch ops that read strided halves of the rows and round twice to
bfloat16. The kernel does the same roundings in one pass (its header gives the arithmetic);
its bfloat16 results equal torch's but for the rare element whose float32 silu sits on a
bfloat16 rounding boundary, one bfloat16 step off then. None where it cannot run (no C
compiler, not a contiguous 2-D bfloat16 CPU tensor of even width): the caller keeps torch's ops.
Rows of a large call (a prompt chunk's) are shared out in contiguous runs (`pool_rows` in `kernels/cpu/pool.h`),
on the C kernels' helper pool or torch's OpenMP pool (`cpu_threads.run_mode`); a row's arithmetic does not change.
"""

from __future__ import annotations

import ctypes

import torch

from kernels.cpu_build import CKernel
from kernels.cpu_threads import kernel_threads, run_mode

__all__ = ["KERNEL", "available", "build_error", "silu_mul_bf16"]


def _declare(lib: ctypes.CDLL) -> None:
    p, q, i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    for name in ("silu_mul_bf16", "silu_mul_bf16_once"):
        getattr(lib, name).argtypes = [p, p, q, q, i, i]
        getattr(lib, name).restype = None


KERNEL = CKernel("silu_mul_bf16.c", ("-fno-math-errno",), _declare, "SwiGLU's activation runs torch's ops",
                  uses_pool=True)


available = KERNEL.available  # whether it builds and loads here (builds it on the first call)
build_error = KERNEL.build_error  # why not, or None


def silu_mul_bf16(gate_up: torch.Tensor, once: bool = False) -> torch.Tensor | None:
    """`F.silu(gate).mul_(up)` [T, I] for bfloat16 gate_up [T, 2I] (gate = the first I columns) on the CPU,
    or None when the kernel cannot run this case. `once`: rounded to bfloat16 once, as torch's ops on the rows
    widened to float32 and the product cast back (`silu_mul_bf16_once`)."""
    if (gate_up.dim() != 2 or gate_up.dtype != torch.bfloat16 or not gate_up.is_cpu
            or not gate_up.is_contiguous() or gate_up.shape[1] % 2):
        return None
    lib = KERNEL.load()
    if lib is None:
        return None
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    y = torch.empty(rows, inter, dtype=torch.bfloat16)
    if rows and inter:
        (lib.silu_mul_bf16_once if once else lib.silu_mul_bf16)(gate_up.data_ptr(), y.data_ptr(), rows, inter,
                                                                kernel_threads(), run_mode())
    return y
