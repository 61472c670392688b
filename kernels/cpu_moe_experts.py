"""An MoE layer's routed experts in one C call (`kernels/cpu/moe_experts.c`, built on first use), dense bfloat16
or float32 weights or INT4 ones: the CPU's grouped path (`backend/moe_experts.py`).

For the slots sorted by expert (rows offsets[e]..offsets[e+1] of xs belong to expert e) every hit expert runs
`down(silu(gate(x)) * up(x))` on its rows through the C GEMV of the weights' format (`cpu_gemv`, `cpu_gemv_f32`,
`cpu_gemv_int4` on bfloat16 activations) and the C SwiGLU activation (`cpu_silu_mul`), each of those its own shared
object with its own tests; this file's C only calls them, expert by expert, with no Python between the calls.

Numerics: the projections are the GEMVs' own (float32 products and sums; bfloat16 outputs rounded once), each
output whole from one thread, so thread counts change no bit; a bfloat16 call equals the loop of `Linear`s over
the experts bit for bit, a float32 call agrees with it to float32 rounding (the loop's activation is torch's), an
INT4 call rounds the activation as the loop does: twice in a bfloat16 model (bit for bit), once in a float32 one
(`round_once`: to the float32 rounding of the silu before it).

Threads: the experts are the chunks of one call on the shared pool (or torch's OpenMP pool, `cpu_threads.run_mode`)
where at least two a thread are hit, each expert's three calls on the thread that claimed it; fewer run in turn,
each call split over the threads as a `Linear`'s is (`cpu_gemv.weight_plan`).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence

import torch

from kernels import cpu_gemv, cpu_gemv_f32, cpu_gemv_int4, cpu_silu_mul
from kernels.cpu_build import CKernel
from kernels.cpu_gemv_int4 import Int4Panels
from kernels.cpu_threads import run_mode

__all__ = ["KERNEL", "INT4", "Int4Experts", "available", "build_error", "moe_experts", "moe_experts_int4"]

_p, _i = ctypes.c_void_p, ctypes.c_int
INT4 = "int4"  # `available`'s key for INT4 experts (the others are their torch dtype)
_INT4_ONCE = "int4, activation rounded once"  # INT4 experts in a float32 model
_SYMBOLS = {torch.bfloat16: (cpu_gemv.KERNEL, "gemv_bf16", "silu_mul_bf16"),
            torch.float32: (cpu_gemv_f32.KERNEL, "gemv_f32", "silu_mul_f32"),
            INT4: (cpu_gemv_int4.KERNEL, "gemv_int4", "silu_mul_bf16"),
            _INT4_ONCE: (cpu_gemv_int4.KERNEL, "gemv_int4", "silu_mul_bf16_once")}


class _Kernels(ctypes.Structure):
    _fields_ = [("gemv", _p), ("silu", _p)]


def _declare(lib: ctypes.CDLL) -> None:
    lib.moe_experts.argtypes = [ctypes.POINTER(_Kernels), _i, _p, _p, _p, _p, _i, _i, _i, _p, _p, _p, _i, _i, _i,
                                _i, _i]
    lib.moe_experts.restype = _i
    lib.moe_experts_int4.argtypes = [ctypes.POINTER(_Kernels), _p, _p, _p, _p, _p, _p, _i, _i, _i, _i, _p, _p, _p, _i,
                                     _i, _i, _i, _i]
    lib.moe_experts_int4.restype = _i


KERNEL = CKernel("moe_experts.c", (), _declare, "MoE experts run one GEMM pair per expert from Python",
                 uses_pool=True)
build_error = KERNEL.build_error  # why not, or None


@functools.lru_cache(maxsize=4)
def _kernels(kind: torch.dtype | str) -> _Kernels | None:
    """The entry points for weights of `kind`, or None where this file or one of them does not build."""
    if kind not in _SYMBOLS or KERNEL.load() is None:
        return None
    gemv_kernel, gemv, silu = _SYMBOLS[kind]
    addresses = gemv_kernel.address(gemv), cpu_silu_mul.KERNEL.address(silu)
    return None if None in addresses else _Kernels(*addresses)


def available(kind: torch.dtype | str) -> bool:
    """Whether experts of `kind` (torch.bfloat16, torch.float32 or `INT4`) run here."""
    return _kernels(kind) is not None


def moe_experts(xs: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """ys [S, H]: for each expert e, rows offsets[e]..offsets[e+1] of xs [S, H] through `down(silu(gate) * up)` with
    w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I]; offsets [E + 1] int64, offsets[E] = S. Contiguous
    CPU tensors of one dtype, `available(dtype)` first; an expert's rows should stay within the GEMV's row limit
    (`Linear.gemv_rows`: more are computed right, only slower than torch's GEMMs). Raises ValueError on other
    shapes, dtypes or layouts."""
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


class Int4Experts:
    """E INT4 experts' panels (`cpu_gemv_int4.pack`'s layout) as the C call takes them: per expert the codes and
    scales of gate_up [2I, H] and down [H, I], in pointer arrays made once (the panels stay referenced here).
    Raises ValueError where the C call cannot take them: differing shapes or groups, or H or I not a multiple of 8
    (the INT4 GEMV's column step, to which the loop pads x per call)."""

    def __init__(self, gate_up: Sequence[Int4Panels], down: Sequence[Int4Panels]) -> None:
        g, d = gate_up[0], down[0]
        self.num_experts, self.hidden, self.inter, self.group = len(gate_up), g.in_features, d.in_features, g.group_size
        if (len(down) != self.num_experts or self.hidden % 8 or self.inter % 8
                or any((p.out_features, p.in_features, p.group_size) != (2 * self.inter, self.hidden, self.group)
                       for p in gate_up)
                or any((p.out_features, p.in_features, p.group_size) != (self.hidden, self.inter, self.group)
                       for p in down)):
            raise ValueError(f"INT4 experts: gate_up {g.out_features}x{g.in_features} / down {d.out_features}x"
                             f"{d.in_features}, group {g.group_size}: need one shape and group for every expert and "
                             "H, I multiples of 8")
        self.panels = (list(gate_up), list(down))  # what the pointers point into
        arrays = [(_p * self.num_experts)(*(getattr(p, field).data_ptr() for p in panels))
                  for panels in self.panels for field in ("codes", "scales_zeros")]
        self.q13, self.sz13, self.q2, self.sz2 = arrays


def moe_experts_int4(xs: torch.Tensor, experts: Int4Experts, offsets: torch.Tensor,
                     round_once: bool = False) -> torch.Tensor:
    """`moe_experts` for INT4 experts: bfloat16 xs [S, H] -> ys [S, H] bfloat16 (`available(INT4)` first; every row
    count runs the INT4 GEMV, as `Int4Linear` does). `round_once`: the activation in float32, rounded to bfloat16
    once (`silu_mul_bf16_once`), as a float32 model's loop of `Int4Linear`s computes it; else bfloat16's two
    roundings, as a bfloat16 model's."""
    e, h, i = experts.num_experts, experts.hidden, experts.inter
    if not (xs.dtype == torch.bfloat16 and xs.dim() == 2 and xs.shape[1] == h and offsets.shape == (e + 1,)
            and offsets.dtype == torch.int64 and xs.is_cpu and xs.is_contiguous() and offsets.is_contiguous()):
        raise ValueError(f"INT4 MoE experts: xs {tuple(xs.shape)} {xs.dtype}, offsets {tuple(offsets.shape)} "
                         f"{offsets.dtype}: need contiguous bfloat16 xs [S, {h}] and int64 offsets [{e + 1}]")
    kernels = _kernels(_INT4_ONCE if round_once else INT4)
    if kernels is None:
        raise RuntimeError(f"MoE experts kernel unavailable for INT4: {KERNEL.error}")
    s = xs.shape[0]
    gate_up, act, ys = xs.new_empty(s, 2 * i), xs.new_empty(s, i), xs.new_empty(s, h)
    threads, _ = cpu_gemv.weight_plan(e * sum(p[0].codes.numel() for p in experts.panels))  # the whole layer's
    _, chunks13 = cpu_gemv_int4.call_plan(1, experts.panels[0][0], threads)
    _, chunks2 = cpu_gemv_int4.call_plan(1, experts.panels[1][0], threads)
    amx = cpu_gemv_int4.amx_code(cpu_gemv_int4.AMX_MIN_ROWS + 1)  # the C GEMV applies it past its own rows
    if KERNEL.load().moe_experts_int4(ctypes.byref(kernels), xs.data_ptr(), experts.q13, experts.sz13, experts.q2,
                                      experts.sz2, offsets.data_ptr(), e, h, i, experts.group, gate_up.data_ptr(),
                                      act.data_ptr(), ys.data_ptr(), amx, run_mode(), threads, chunks13,
                                      chunks2) != 0:
        raise MemoryError(f"INT4 MoE experts: a GEMV could not allocate its group sums ({s} slots of {h})")
    return ys
