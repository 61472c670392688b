"""Every decoder layer of a dense bfloat16 or float32 model's step in one C call (`kernels/cpu/decode_layers.c`).

A decode step of SmolLM2 on the CPU was ~300 calls from Python into the C kernels (per layer: four
GEMVs, two RoPE passes in one call, the KV store, the paged attention, two residual add + norms,
SwiGLU's activation), each behind its wrapper's checks, a tensor allocation and a ctypes crossing:
6-15 µs a call, about 5 ms of a 17 ms step at one decode row (`edgeserve bench token-profile`). The C
file calls the same kernels in the same order with the same threads and chunks, so the step's
results are bit for bit the Python path's (tested); what it saves is the Python between them.

A float32 model runs the kernels' float32 twins (`gemv_f32`, `rope_f32`, `add_rms_norm_f32`, `silu_mul_f32`,
4-byte KV rows, fp32 pages): the Python layers run float32 on torch ops, so there the step agrees with them to
float32 rounding (tested against them with a tolerance), not bit for bit.

`DecodeLayers` is built once per model and KV cache (the layers' weight and page addresses) and
run once per step with that step's rows (decode rows, and prompt rows in the attention's tiles); `available()` says whether every kernel it calls builds
here (each is its own shared object: the fused file gets their entry points).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels import (cpu_gemv, cpu_gemv_f32, cpu_gemv_int4, cpu_kv_store, cpu_paged_attention, cpu_rms_norm, cpu_rope,
                     cpu_silu_mul)
from kernels.cpu_build import CKernel
from kernels.cpu_gemv_int4 import Int4Panels
from kernels.cpu_threads import kernel_threads, run_mode

__all__ = ["available", "float32_available", "build_error", "DecodeLayers", "LayerTensors", "Refused", "TIMED_PARTS",
           "Weight"]

TIMED_PARTS = ("gemv", "attention", "rope", "kv_store", "norms", "silu")  # the C file's `seconds` accumulators
Weight = torch.Tensor | Int4Panels  # a linear's weight: bfloat16 or float32 [N, K], or INT4 panels
_MAX_HEAD_DIM, _MAX_GROUP = 256, 32  # the attention kernel's MAX_HD and MAX_G

_p, _i, _q, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float


class _Kernels(ctypes.Structure):
    _fields_ = [(n, _p) for n in ("gemv", "gemv_int4", "rope", "store_rows", "store_fp8", "attend", "add_norm",
                                  "silu", "gemv_f32", "rope_f32", "add_norm_f32", "silu_f32")]


class _Layer(ctypes.Structure):
    _fields_ = [("w", _p * 4), ("sz", _p * 4),
                *((n, _p) for n in ("post_norm", "next_norm", "k_pages", "v_pages", "k_exps", "v_exps"))]


class _Step(ctypes.Structure):
    _fields_ = [*((n, _i) for n in ("M", "hidden", "H", "KVH", "HD", "pairs", "inter")),
                ("threads", _i * 4), ("chunks", _i * 4), ("fma", _i * 4), ("group", _i * 4), ("row_threads", _i),
                ("linger", _i),
                ("attend_min_rows", _q), ("eps", _f), ("scale", _f), ("fp8", _i), ("freqs", _p), ("slots", _p),
                ("nslots", _q), ("table", _p), ("lens", _p), ("tiles", _p), ("ntiles", _i), ("maxp", _i),
                ("page_size", _i),
                *((n, _p) for n in ("h", "x", "qkv", "q", "k", "attn", "branch", "gate_up", "act", "mlp_out",
                                    "seconds")), ("elem", _i)]


def _declare(lib: ctypes.CDLL) -> None:
    lib.decode_layers.argtypes = [ctypes.POINTER(_Kernels), ctypes.POINTER(_Layer), _i, ctypes.POINTER(_Step)]
    lib.decode_layers.restype = _i


KERNEL = CKernel("decode_layers.c", (), _declare, "a decode step calls each layer's kernels from Python")
_PARTS = ((cpu_gemv.KERNEL, "gemv_bf16"), (cpu_gemv_int4.KERNEL, "gemv_int4"), (cpu_rope.KERNEL, "rope_bf16"),
          (cpu_kv_store.ROWS_KERNEL, "store_kv_rows"), (cpu_kv_store.KERNEL, "store_kv_fp8"),
          (cpu_paged_attention.KERNEL, "paged_decode"), (cpu_rms_norm.KERNEL, "add_rms_norm_bf16"),
          (cpu_silu_mul.KERNEL, "silu_mul_bf16"), (cpu_gemv_f32.KERNEL, "gemv_f32"), (cpu_rope.KERNEL, "rope_f32"),
          (cpu_rms_norm.KERNEL, "add_rms_norm_f32"), (cpu_silu_mul.KERNEL, "silu_mul_f32"))
_OPTIONAL = ("gemv_int4", "gemv_f32", "rope_f32", "add_rms_norm_f32", "silu_mul_f32")  # formats a host may lack


@functools.lru_cache(maxsize=1)
def _kernels() -> _Kernels | None:
    """The entry points the fused file calls, or None where one of them (or the file) does not build (the INT4
    GEMV may be missing: then `DecodeLayers` takes no INT4 weights; the float32 kernels: then no float32 model)."""
    if KERNEL.load() is None:
        return None
    addresses = {symbol: k.address(symbol) for k, symbol in _PARTS}
    required = [a for symbol, a in addresses.items() if symbol not in _OPTIONAL]
    return None if None in required else _Kernels(*addresses.values())


def available() -> bool:
    """Whether the fused file and every kernel it calls build and load here."""
    return _kernels() is not None


def float32_available() -> bool:
    """Whether float32 models run fused here too (their kernels build)."""
    kernels = _kernels()
    return kernels is not None and all((kernels.gemv_f32, kernels.rope_f32, kernels.add_norm_f32, kernels.silu_f32))


def build_error() -> str | None:
    """Why not (the first kernel that does not build), or None."""
    for k in (KERNEL, *(k for k, symbol in _PARTS if symbol not in _OPTIONAL)):
        if k.load() is None:
            return f"{k.source.name}: {k.error}"
    return None


@dataclass
class LayerTensors:
    """One layer's tensors as the fused call reads them: its linears' weights, each bfloat16 [N, K] (contiguous)
    or INT4 panels (`cpu_gemv_int4.pack`, K a multiple of 8), or every one float32 [N, K]; norms [hidden] in the
    weights' dtype, and its KV pages [P, S, KVH, HD] (that dtype, or fp8_e4m3 with exponents [P, S, KVH])."""

    qkv: Weight
    o_proj: Weight
    gate_up: Weight
    down: Weight
    post_norm: torch.Tensor
    next_norm: torch.Tensor | None  # the next layer's input norm; None on the last layer
    k_pages: torch.Tensor
    v_pages: torch.Tensor
    k_exps: torch.Tensor | None = None
    v_exps: torch.Tensor | None = None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _shape(w: Weight) -> tuple[int, int]:
    """[N, K] of a weight in either format."""
    return (w.out_features, w.in_features) if isinstance(w, Int4Panels) else tuple(w.shape)


def _format(w: Weight) -> int:
    """0 for bfloat16, -1 for float32, else the INT4 group size."""
    return w.group_size if isinstance(w, Int4Panels) else (-1 if w.dtype == torch.float32 else 0)


def _check(w: Weight) -> None:
    if isinstance(w, Int4Panels):
        if w.in_features % 8 or not cpu_gemv_int4.available():
            raise ValueError("INT4 weights the fused layers cannot take (K not a multiple of 8, or no INT4 GEMV)")
    elif w.dtype not in (torch.bfloat16, torch.float32) or not w.is_contiguous() or not w.is_cpu:
        raise ValueError("the fused decode layers need contiguous bfloat16 or float32 CPU weights")
    elif w.dtype == torch.float32 and not float32_available():
        raise ValueError("the float32 kernels do not build here")


class Refused(RuntimeError):
    """The fused call did not take the step (nothing the caller holds changed: run it another way)."""


class DecodeLayers:
    """The layers of one model over one KV cache, for `run` once per decode step."""

    def __init__(self, layers: Sequence[LayerTensors], num_heads: int, num_kv_heads: int, head_dim: int,
                 eps: float) -> None:
        first = layers[0]
        self.H, self.KVH, self.HD, self.eps = num_heads, num_kv_heads, head_dim, eps
        self.hidden, self.inter = _shape(first.o_proj)[0], _shape(first.down)[1]
        self.fp8 = first.k_pages.dtype == torch.float8_e4m3fn
        weights = [(t.qkv, t.o_proj, t.gate_up, t.down) for t in layers]
        self._first = weights[0]  # every layer's linears share these formats and shapes (checked): the call plans
        self._formats = [_format(w) for w in self._first]  # per linear: 0 bfloat16, -1 float32, else INT4's group
        if -1 in self._formats and set(self._formats) != {-1}:
            raise ValueError("a float32 model's fused layers take float32 weights only")
        self.dtype = torch.float32 if -1 in self._formats else torch.bfloat16  # the rows' dtype
        shapes = [_shape(w) for w in self._first]
        for t, ws in zip(layers, weights):
            for w in ws:
                _check(w)
            if [_format(w) for w in ws] != self._formats or [_shape(w) for w in ws] != shapes:
                raise ValueError("the fused decode layers need every layer in one format and shape")
            if not all(x.is_contiguous() and x.is_cpu for x in (t.post_norm, t.k_pages, t.v_pages)):
                raise ValueError("the fused decode layers need contiguous CPU norms and pages")
            norms = (t.post_norm, t.next_norm) if t.next_norm is not None else (t.post_norm,)
            if any(n.dtype != self.dtype for n in norms) or t.k_pages.dtype not in (self.dtype, torch.float8_e4m3fn):
                raise ValueError("the fused decode layers need norms and pages in the weights' dtype (or fp8 pages)")
        if head_dim > _MAX_HEAD_DIM or num_heads % num_kv_heads or num_heads // num_kv_heads > _MAX_GROUP:
            raise ValueError(f"attention shape beyond the kernel's (head_dim {head_dim}, heads {num_heads}/"
                             f"{num_kv_heads})")

        def codes(w: Weight) -> int:
            return w.codes.data_ptr() if isinstance(w, Int4Panels) else w.data_ptr()

        def scales(w: Weight) -> int | None:
            return w.scales_zeros.data_ptr() if isinstance(w, Int4Panels) else None

        self._layers = (_Layer * len(layers))(*(
            _Layer((_p * 4)(*map(codes, ws)), (_p * 4)(*map(scales, ws)),
                   *map(_ptr, (t.post_norm, t.next_norm, t.k_pages, t.v_pages, t.k_exps, t.v_exps)))
            for t, ws in zip(layers, weights)))
        self._keep = list(layers)  # the addresses above stay valid while this object lives
        self.page_size = first.k_pages.shape[1]
        self.nslots = first.k_pages.shape[0] * self.page_size
        self.seconds: list[float] | None = None  # set to [0.0] * 6 to accumulate TIMED_PARTS (token-profile)

    def run(self, h: torch.Tensor, x: torch.Tensor, freqs: torch.Tensor, slots: torch.Tensor,
            page_table: torch.Tensor, context_lens: torch.Tensor, scale: float,
            tiles: torch.Tensor | None = None) -> torch.Tensor:
        """All layers over rows h [M, hidden] (the residual stream, updated in place) from x [M, hidden] (the
        first layer's input norm of h): returns the last layer's MLP output [M, hidden], which the caller adds
        into h. freqs [M, 1, pairs] complex64 (`RotaryEmbedding.tables`), slots [M] int64, page_table [M, P]
        int64, context_lens [M] (keys each row sees, this token's included), tiles: the attention's tiles of
        prompt rows (`cpu_paged_attention.paged_decode_attention_cpu`'s; None: every row alone, decode rows).
        `Refused` (h and x untouched) where the attention kernel does not take the step's tiles."""
        kernels = _kernels()
        if kernels is None:
            raise RuntimeError(f"the fused decode layers are unavailable: {build_error()}")
        m, hd = h.shape[0], self.HD
        pairs = freqs.shape[-1]
        rows = (h, x)  # the C file trusts these shapes: a wrong one would read or write past a buffer
        if (any(t.shape != (m, self.hidden) or t.dtype != self.dtype or not t.is_contiguous() for t in rows)
                or freqs.dtype != torch.complex64 or not freqs.is_contiguous() or freqs.numel() != m * pairs
                or 2 * pairs > hd or slots.dtype != torch.int64 or slots.numel() != m
                or page_table.dim() != 2 or page_table.shape[0] != m or context_lens.numel() != m):
            raise ValueError("fused decode layers: step tensors of the wrong shape, dtype or layout")
        qkv_n = (self.H + 2 * self.KVH) * hd
        bf = self.dtype
        bufs = {"qkv": torch.empty(m, qkv_n, dtype=bf), "q": torch.empty(m, self.H * hd, dtype=bf),
                "k": torch.empty(m, self.KVH * hd, dtype=bf), "attn": torch.empty(m, self.H * hd, dtype=bf),
                "branch": torch.empty(m, self.hidden, dtype=bf), "gate_up": torch.empty(m, 2 * self.inter, dtype=bf),
                "act": torch.empty(m, self.inter, dtype=bf), "mlp_out": torch.empty(m, self.hidden, dtype=bf)}
        plans = [(*cpu_gemv_int4.call_plan(m, w), cpu_gemv_int4.amx_code(m)) if isinstance(w, Int4Panels)
                 else (cpu_gemv_f32 if self.dtype == torch.float32 else cpu_gemv).call_plan(m, *_shape(w))
                 for w in self._first]
        tiles = None if tiles is None else tiles.to(torch.int32).contiguous()
        table = page_table.to(torch.int64).contiguous()
        lens = context_lens.to(torch.int32).contiguous()
        slots = slots.contiguous()
        seconds = (ctypes.c_double * len(TIMED_PARTS))() if self.seconds is not None else None
        step = _Step(m, self.hidden, self.H, self.KVH, hd, pairs, self.inter,
                     (_i * 4)(*(p[0] for p in plans)), (_i * 4)(*(p[1] for p in plans)),
                     (_i * 4)(*(p[2] for p in plans)), (_i * 4)(*self._formats), kernel_threads(),
                     run_mode(),
                     cpu_paged_attention.THREADED_ROWS, self.eps, scale, int(self.fp8), freqs.data_ptr(),
                     slots.data_ptr(), self.nslots, table.data_ptr(), lens.data_ptr(),
                     None if tiles is None else tiles.data_ptr(), 0 if tiles is None else tiles.numel() - 1,
                     table.shape[1],
                     self.page_size, h.data_ptr(), x.data_ptr(),
                     *(bufs[n].data_ptr() for n in ("qkv", "q", "k", "attn", "branch", "gate_up", "act", "mlp_out")),
                     ctypes.cast(seconds, ctypes.c_void_p) if seconds is not None else None,
                     self.dtype.itemsize)
        rc = KERNEL.load().decode_layers(ctypes.byref(kernels), self._layers, len(self._layers), ctypes.byref(step))
        if seconds is not None:
            self.seconds = [a + b for a, b in zip(self.seconds, seconds)]
        if rc == -1:
            raise MemoryError(f"a GEMV found no memory for its working copy of a [{m}, *] input")
        if rc == -2:
            raise IndexError(f"a KV slot is outside the pool's {self.nslots} slots")
        if rc != 0:
            raise Refused(f"the attention kernel refused the step's shapes or tiles (code {rc})")
        return bufs["mlp_out"]
