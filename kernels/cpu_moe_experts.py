"""An MoE layer's routed experts in one C call (`kernels/cpu/moe_experts.c`, built on first use), dense bfloat16
or float32 weights: the CPU's grouped path (`backend/moe_experts.py`).

For the slots sorted by expert (rows offsets[e]..offsets[e+1] of xs belong to expert e) every hit expert runs
`down(silu(gate(x)) * up(x))` on its rows through the C GEMV of the weights' dtype (`cpu_gemv`, `cpu_gemv_f32`) and
the C SwiGLU activation (`cpu_silu_mul`), each of those its own shared object with its own tests; this file's C
only calls them, expert by expert, with no Python between the calls.

Numerics: the projections are the GEMVs' own (float32 products and sums; bfloat16 outputs rounded once), each
output whole from one thread, so thread counts change no bit; a bfloat16 call equals the loop of `Linear`s over
the experts bit for bit, a float32 call agrees with it to float32 rounding (the loop's activation is torch's).

Threads: the experts are the chunks of one call on the shared pool (or torch's OpenMP pool, `cpu_threads.run_mode`)
where at least two a thread are hit, each expert's three calls on the thread that claimed it; fewer run in turn,
each call split over the threads as a `Linear`'s is (`cpu_gemv.weight_plan`).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kernels import cpu_gemv, cpu_gemv_f32, cpu_silu_mul
from kernels.cpu_build import CKernel
from kernels.cpu_threads import run_mode

__all__ = ["KERNEL", "available", "build_error", "max_rows", "moe_experts"]

_p, _i = ctypes.c_void_p, ctypes.c_int
_SYMBOLS = {torch.bfloat16: (cpu_gemv.KERNEL, "gemv_bf16", "silu_mul_bf16"),
            torch.float32: (cpu_gemv_f32.KERNEL, "gemv_f32", "silu_mul_f32")}


class _Kernels(ctypes.Structure):
    _fields_ = [("gemv", _p), ("silu", _p)]


def _declare(lib: ctypes.CDLL) -> None:
    lib.moe_experts.argtypes = [ctypes.POINTER(_Kernels), _i, _p, _p, _p, _p, _i, _i, _i, _p, _p, _p, _i, _i, _i,
                                _i, _i]
    lib.moe_experts.restype = _i


KERNEL = CKernel("moe_experts.c", (), _declare, "MoE experts run one GEMM pair per expert from Python",
                 uses_pool=True)
build_error = KERNEL.build_error  # why not, or None


@functools.lru_cache(maxsize=2)
def _kernels(dtype: torch.dtype) -> _Kernels | None:
    """The entry points for `dtype`'s weights, or None where this file or one of them does not build."""
    if dtype not in _SYMBOLS or KERNEL.load() is None:
        return None
    gemv_kernel, gemv, silu = _SYMBOLS[dtype]
    addresses = gemv_kernel.address(gemv), cpu_silu_mul.KERNEL.address(silu)
    return None if None in addresses else _Kernels(*addresses)


def available(dtype: torch.dtype) -> bool:
    """Whether experts of `dtype` (bfloat16 or float32) run here."""
    return _kernels(dtype) is not None


def max_rows(dtype: torch.dtype) -> int:
    """Rows an expert may hold in a call: the GEMV's own limit for `dtype` (`cpu_gemv.max_rows`,
    `cpu_gemv_f32.max_rows`), past which torch's GEMMs are the faster path."""
    return cpu_gemv.max_rows() if dtype == torch.bfloat16 else cpu_gemv_f32.max_rows()


def moe_experts(xs: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """ys [S, H]: for each expert e, rows offsets[e]..offsets[e+1] of xs [S, H] through `down(silu(gate) * up)` with
    w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I]; offsets [E + 1] int64, offsets[E] = S. Contiguous
    CPU tensors of one dtype, `available(dtype)` first; an expert's rows should stay within `max_rows` (more are
    computed right, only slower than torch's GEMMs). Raises ValueError on other shapes, dtypes or layouts."""
    e, two_i, h = w13.shape
    i = two_i // 2
    if not (xs.dtype == w13.dtype == w2.dtype and xs.dim() == 2 and xs.shape[1] == h and two_i == 2 * i
            and w2.shape == (e, h, i) and offsets.shape == (e + 1,) and offsets.dtype == torch.int64
            and all(t.is_cpu and t.is_contiguous() for t in (xs, w13, w2, offsets))):
        raise ValueError(f"MoE experts: xs {tuple(xs.shape)} {xs.dtype}, w13 {tuple(w13.shape)} {w13.dtype}, "
                         f"w2 {tuple(w2.shape)} {w2.dtype}, offsets {tuple(offsets.shape)} {offsets.dtype}: need "
                         "contiguous CPU tensors of one dtype, w13 [E, 2I, H], w2 [E, H, I], int64 offsets [E + 1]")
    kernels = _kernels(xs.dtype)
    if kernels is None:
        raise RuntimeError(f"MoE experts kernel unavailable for {xs.dtype}: {KERNEL.error}")
    s = xs.shape[0]
    gate_up = xs.new_empty(s, two_i)
    act, ys = xs.new_empty(s, i), xs.new_empty(s, h)
    elem = xs.element_size()
    threads, _ = cpu_gemv.weight_plan(e * 3 * i * h * elem)  # the whole layer's weights
    _, chunks13 = cpu_gemv.weight_plan(two_i * h * elem, threads)
    _, chunks2 = cpu_gemv.weight_plan(h * i * elem, threads)
    fma = cpu_gemv.tile_code() if xs.dtype == torch.bfloat16 else 0
    if KERNEL.load().moe_experts(ctypes.byref(kernels), elem, xs.data_ptr(), w13.data_ptr(), w2.data_ptr(),
                                 offsets.data_ptr(), e, h, i, gate_up.data_ptr(), act.data_ptr(), ys.data_ptr(), fma,
                                 run_mode(), threads, chunks13, chunks2) != 0:
        raise MemoryError(f"MoE experts: a GEMV could not allocate its widened input ({s} slots of {h})")
    return ys
