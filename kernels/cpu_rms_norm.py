"""RMSNorm of bfloat16 rows in one C call (`kernels/cpu/rms_norm_bf16.c`, built on first use).

`backend/layers/norm.py` computes a bfloat16 RMSNorm as the reference does: widen to float32,
normalise, round to bfloat16, multiply by the bfloat16 weight. In torch that is four ops, each a
dispatch of a few microseconds on a row of a few hundred values: ~18 µs a call at one row of
576 on one core of a 2-core AMD EPYC VM, twice per layer, so ~1 ms of a c = 1 decode step of
SmolLM2. The kernel does the same arithmetic in one pass per row (see its header for the
rounding) and returns None where it cannot run (no C compiler, not bfloat16, not contiguous,
not on the CPU, a weight that is not one row), so the caller keeps its torch path.
`add_rms_norm_bf16` first adds a layer's residual branch into the rows in place (rounded as
torch's bfloat16 add rounds it), so a decoder layer's `h += branch; x = norm(h)` is one call.
Rows of a large call (a prompt chunk's) are shared out in contiguous runs (`pool_rows` in `kernels/cpu/pool.h`),
on the C kernels' helper pool or torch's OpenMP pool (`cpu_threads.run_mode`); a row's arithmetic does not change.
"""

from __future__ import annotations

import ctypes

import torch

from kernels.cpu_build import CKernel
from kernels.cpu_threads import kernel_threads, run_mode

__all__ = ["KERNEL", "available", "build_error", "rms_norm_bf16", "add_rms_norm_bf16"]


def _declare(lib: ctypes.CDLL) -> None:
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.rms_norm_bf16.argtypes = [p, p, p, i, i, ctypes.c_float, i, i]
    lib.rms_norm_bf16.restype = None
    lib.add_rms_norm_bf16.argtypes = [p, p, p, p, i, i, ctypes.c_float, i, i]
    lib.add_rms_norm_bf16.restype = None


KERNEL = CKernel("rms_norm_bf16.c", ("-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math",
                                      "-fno-math-errno"), _declare, "bfloat16 RMSNorm runs its torch ops",
                  uses_pool=True)


available = KERNEL.available  # whether it builds and loads here (builds it on the first call)
build_error = KERNEL.build_error  # why not, or None


def _run(name: str, x: torch.Tensor, weight: torch.Tensor, eps: float,
         delta: torch.Tensor | None = None) -> torch.Tensor | None:
    """The kernel `name` over bfloat16 rows x [..., n] with weight [n] (and the branch `delta`, x's shape,
    added into x first), or None, nothing touched, where it cannot run."""
    if (x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or not x.is_cpu or weight.dim() != 1
            or x.dim() == 0 or weight.shape[0] != x.shape[-1] or not x.is_contiguous() or not weight.is_contiguous()):
        return None
    if delta is not None and (delta.dtype != torch.bfloat16 or delta.shape != x.shape or not delta.is_contiguous()
                              or not delta.is_cpu):
        return None
    lib = KERNEL.load()
    if lib is None:
        return None
    y = torch.empty_like(x)
    n = x.shape[-1]
    rows = x.numel() // n if n else 0
    if rows:
        branch = () if delta is None else (delta.data_ptr(),)
        getattr(lib, name)(x.data_ptr(), *branch, weight.data_ptr(), y.data_ptr(), rows, n, eps, kernel_threads(),
                           run_mode())
    return y


def rms_norm_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """`weight * rms_norm(x.float(), eps).to(bfloat16)` over x's last dim for bfloat16 x [..., n] and
    weight [n] on the CPU, or None when the kernel cannot run this case."""
    return _run("rms_norm_bf16", x, weight, eps)


def add_rms_norm_bf16(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """`h.add_(delta)` then `rms_norm_bf16(h, weight, eps)` in one call for bfloat16 rows (h updated in place,
    bit-identical to torch's add), or None, with h untouched, when the kernel cannot run this case."""
    return _run("add_rms_norm_bf16", h, weight, eps, delta)
