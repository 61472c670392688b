"""Every decoder layer of a dense bfloat16 decode step in one C call (`kernels/cpu/decode_layers.c`).

A decode step of SmolLM2 on the CPU was ~300 calls from Python into the C kernels (per layer: four
GEMVs, two RoPE passes in one call, the KV store, the paged attention, two residual add + norms,
SwiGLU's activation), each behind its wrapper's checks, a tensor allocation and a ctypes crossing:
6-15 µs a call, about 5 ms of a 17 ms step at one decode row (`edgeserve bench token-profile`). The C
file calls the same kernels in the same order with the same threads and chunks, so the step's
results are bit for bit the Python path's (tested); what it saves is the Python between them.

`DecodeLayers` is built once per model and KV cache (the layers' weight and page addresses) and
run once per step with that step's rows; `available()` says whether every kernel it calls builds
here (each is its own shared object: the fused file gets their entry points).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels import cpu_gemv, cpu_kv_store, cpu_paged_attention, cpu_rms_norm, cpu_rope, cpu_silu_mul
from kernels.cpu_build import CKernel
from kernels.cpu_threads import kernel_threads, kernels_own_threads

__all__ = ["available", "build_error", "DecodeLayers", "LayerTensors", "TIMED_PARTS"]

TIMED_PARTS = ("gemv", "attention", "rope", "kv_store", "norms", "silu")  # the C file's `seconds` accumulators
_MAX_HEAD_DIM, _MAX_GROUP = 256, 32  # the attention kernel's MAX_HD and MAX_G

_p, _i, _q, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float


class _Kernels(ctypes.Structure):
    _fields_ = [(n, _p) for n in ("gemv", "rope", "store_rows", "store_fp8", "attend", "add_norm", "silu")]


class _Layer(ctypes.Structure):
    _fields_ = [(n, _p) for n in ("qkv", "o", "gate_up", "down", "post_norm", "next_norm", "k_pages", "v_pages",
                                  "k_exps", "v_exps")]


class _Step(ctypes.Structure):
    _fields_ = [*((n, _i) for n in ("M", "hidden", "H", "KVH", "HD", "pairs", "inter")),
                ("threads", _i * 4), ("chunks", _i * 4), ("fma", _i * 4), ("row_threads", _i), ("linger", _i),
                ("attend_min_rows", _q), ("eps", _f), ("scale", _f), ("fp8", _i), ("freqs", _p), ("slots", _p),
                ("nslots", _q), ("table", _p), ("lens", _p), ("maxp", _i), ("page_size", _i),
                *((n, _p) for n in ("h", "x", "qkv", "q", "k", "attn", "branch", "gate_up", "act", "mlp_out",
                                    "seconds"))]


def _declare(lib: ctypes.CDLL) -> None:
    lib.decode_layers.argtypes = [ctypes.POINTER(_Kernels), ctypes.POINTER(_Layer), _i, ctypes.POINTER(_Step)]
    lib.decode_layers.restype = _i


KERNEL = CKernel("decode_layers.c", (), _declare, "a decode step calls each layer's kernels from Python")
_PARTS = ((cpu_gemv.KERNEL, "gemv_bf16"), (cpu_rope.KERNEL, "rope_bf16"),
          (cpu_kv_store.ROWS_KERNEL, "store_kv_rows"), (cpu_kv_store.KERNEL, "store_kv_fp8"),
          (cpu_paged_attention.KERNEL, "paged_decode"), (cpu_rms_norm.KERNEL, "add_rms_norm_bf16"),
          (cpu_silu_mul.KERNEL, "silu_mul_bf16"))


@functools.lru_cache(maxsize=1)
def _kernels() -> _Kernels | None:
    """The entry points the fused file calls, or None where one of them (or the file) does not build."""
    if KERNEL.load() is None:
        return None
    addresses = [k.address(symbol) for k, symbol in _PARTS]
    return None if None in addresses else _Kernels(*addresses)


def available() -> bool:
    """Whether the fused file and every kernel it calls build and load here."""
    return _kernels() is not None


def build_error() -> str | None:
    """Why not (the first kernel that does not build), or None."""
    for k in (KERNEL, *(k for k, _ in _PARTS)):
        if k.load() is None:
            return f"{k.source.name}: {k.error}"
    return None


@dataclass
class LayerTensors:
    """One layer's tensors as the fused call reads them: bfloat16 weights [N, K] (contiguous), norms [hidden],
    and its KV pages [P, S, KVH, HD] (bfloat16, or fp8_e4m3 with exponents [P, S, KVH])."""

    qkv: torch.Tensor
    o_proj: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    post_norm: torch.Tensor
    next_norm: torch.Tensor | None  # the next layer's input norm; None on the last layer
    k_pages: torch.Tensor
    v_pages: torch.Tensor
    k_exps: torch.Tensor | None = None
    v_exps: torch.Tensor | None = None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class DecodeLayers:
    """The layers of one model over one KV cache, for `run` once per decode step."""

    def __init__(self, layers: Sequence[LayerTensors], num_heads: int, num_kv_heads: int, head_dim: int,
                 eps: float) -> None:
        first = layers[0]
        self.H, self.KVH, self.HD, self.eps = num_heads, num_kv_heads, head_dim, eps
        self.hidden, self.inter = first.o_proj.shape[0], first.down.shape[1]
        self.fp8 = first.k_pages.dtype == torch.float8_e4m3fn
        for t in layers:
            tensors = (t.qkv, t.o_proj, t.gate_up, t.down, t.post_norm, t.k_pages, t.v_pages)
            if not all(x.is_contiguous() and x.is_cpu for x in tensors):
                raise ValueError("the fused decode layers need contiguous CPU tensors")
        if head_dim > _MAX_HEAD_DIM or num_heads % num_kv_heads or num_heads // num_kv_heads > _MAX_GROUP:
            raise ValueError(f"attention shape beyond the kernel's (head_dim {head_dim}, heads {num_heads}/"
                             f"{num_kv_heads})")
        self._layers = (_Layer * len(layers))(*(
            _Layer(*map(_ptr, (t.qkv, t.o_proj, t.gate_up, t.down, t.post_norm, t.next_norm, t.k_pages, t.v_pages,
                               t.k_exps, t.v_exps))) for t in layers))
        self._keep = list(layers)  # the addresses above stay valid while this object lives
        self.page_size = first.k_pages.shape[1]
        self.nslots = first.k_pages.shape[0] * self.page_size
        self._shapes = [(t.qkv.shape[0], self.hidden), (self.hidden, num_heads * head_dim),
                        (t.gate_up.shape[0], self.hidden), (self.hidden, self.inter)]
        self.seconds: list[float] | None = None  # set to [0.0] * 6 to accumulate TIMED_PARTS (token-profile)

    def run(self, h: torch.Tensor, x: torch.Tensor, freqs: torch.Tensor, slots: torch.Tensor,
            page_table: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
        """All layers over decode rows h [M, hidden] (the residual stream, updated in place) from x [M, hidden]
        (the first layer's input norm of h): returns the last layer's MLP output [M, hidden], which the caller
        adds into h. freqs [M, 1, pairs] complex64 (`RotaryEmbedding.tables`), slots [M] int64, page_table
        [M, P] int64, context_lens [M] (keys each row sees, this token's included)."""
        kernels = _kernels()
        if kernels is None:
            raise RuntimeError(f"the fused decode layers are unavailable: {build_error()}")
        m, hd = h.shape[0], self.HD
        qkv_n = (self.H + 2 * self.KVH) * hd
        bf = torch.bfloat16
        bufs = {"qkv": torch.empty(m, qkv_n, dtype=bf), "q": torch.empty(m, self.H * hd, dtype=bf),
                "k": torch.empty(m, self.KVH * hd, dtype=bf), "attn": torch.empty(m, self.H * hd, dtype=bf),
                "branch": torch.empty(m, self.hidden, dtype=bf), "gate_up": torch.empty(m, 2 * self.inter, dtype=bf),
                "act": torch.empty(m, self.inter, dtype=bf), "mlp_out": torch.empty(m, self.hidden, dtype=bf)}
        plans = [cpu_gemv.call_plan(m, n, k) for n, k in self._shapes]
        table = page_table.to(torch.int64).contiguous()
        lens = context_lens.to(torch.int32).contiguous()
        slots = slots.contiguous()
        seconds = (ctypes.c_double * len(TIMED_PARTS))() if self.seconds is not None else None
        step = _Step(m, self.hidden, self.H, self.KVH, hd, freqs.shape[-1], self.inter,
                     (_i * 4)(*(p[0] for p in plans)), (_i * 4)(*(p[1] for p in plans)),
                     (_i * 4)(*(p[2] for p in plans)), kernel_threads(), int(kernels_own_threads()),
                     cpu_paged_attention.THREADED_ROWS, self.eps, scale, int(self.fp8), freqs.data_ptr(),
                     slots.data_ptr(), self.nslots, table.data_ptr(), lens.data_ptr(), table.shape[1],
                     self.page_size, h.data_ptr(), x.data_ptr(),
                     *(bufs[n].data_ptr() for n in ("qkv", "q", "k", "attn", "branch", "gate_up", "act", "mlp_out")),
                     ctypes.cast(seconds, ctypes.c_void_p) if seconds is not None else None)
        rc = KERNEL.load().decode_layers(ctypes.byref(kernels), self._layers, len(self._layers), ctypes.byref(step))
        if seconds is not None:
            self.seconds = [a + b for a, b in zip(self.seconds, seconds)]
        if rc == -1:
            raise MemoryError(f"bf16 GEMV: no memory to widen a [{m}, *] input")
        if rc == -2:
            raise IndexError(f"a KV slot is outside the pool's {self.nslots} slots")
        if rc != 0:
            raise RuntimeError(f"the fused decode layers refused the step (code {rc})")
        return bufs["mlp_out"]
