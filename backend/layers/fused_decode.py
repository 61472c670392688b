"""Which steps run every decoder layer in one C call, and the per-model object that does it.

`kernels/cpu_decode_layers.py` runs a dense bfloat16 model's layers (attention and SwiGLU MLP) for a
step by calling the same C kernels as the Python layers, in the same order, with the same threads:
bit for bit the same logits and KV pages, without ~10 Python-to-C crossings a layer. A float32 model
runs the kernels' float32 twins the same way (its Python layers run torch's float32 ops: the same
values to float32 rounding), for steps of up to `cpu_gemv_f32.max_rows()` rows; larger steps keep the
Python layers and MKL's GEMM.
A model takes it when all of these hold, checked once per model and KV cache (`fused_layers`):
bfloat16 or float32 compute on the CPU, one process (no tensor parallelism), every layer dense GQA
attention without q/k norms or biases and a SwiGLU MLP, each linear on a C GEMV (bfloat16, float32 or
INT4), KV pages in the compute dtype or FP8, and every kernel built here; and per step (`DecoderModel._run_fused`,
`runs_step`): no more rows than the C GEMV takes, every row on one phase's weights (a decode step, a
prompt step, or any step where both phases share one format; prompt chunks' rows in the attention
kernel's tiles). Each phase's layers get their own call (`fused_layers(model, cache, phase)`), so a
worker whose decode weights are INT4 and prompt weights bfloat16 runs a step of both kinds of rows as
two calls, the prompt rows' and then the decode rows': rows of different sequences, so neither call
reads what the other writes, and each row's arithmetic is the Python layers' (which also run each
part's linears on its own rows). The decode weights may be INT4 (`Int4Linear` on its C GEMV) as well
as bfloat16. Everything else (MoE, MLA, larger steps, other hosts) runs the Python layers as before.
`EDGESERVE_FUSED_DECODE=0` turns it off.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from backend.linear import Int4Linear, Linear
from kernels import cpu_decode_layers, cpu_gemv, cpu_gemv_f32
from kernels.cpu_decode_layers import DecodeLayers, LayerTensors

if TYPE_CHECKING:
    from backend.kv_cache import PagedKVCache
    from backend.model import DecoderModel

__all__ = ["enabled_by_env", "fused_layers", "runs_step", "runs_split_step"]


def enabled_by_env() -> bool:
    """Whether `EDGESERVE_FUSED_DECODE` leaves the fused path on (any value but 0)."""
    return os.environ.get("EDGESERVE_FUSED_DECODE", "1") != "0"


def _linears(layer: Any) -> list[Any]:
    return [layer.qkv, layer.o_proj, layer.gate_up, layer.down]


def _c_weight(w: Any) -> Any:
    """The weight the C GEMVs read for linear w (bfloat16 [N, K] or INT4 panels), or None where w runs
    something else (torch's GEMM, a bias, another format)."""
    if isinstance(w, Linear) and w.gemv and w.bias is None:
        return w.weight
    if isinstance(w, Int4Linear) and not w.cuda and w.panels is not None and w.bias is None:
        return w.panels
    return None


def _eligible_layer(layer: Any) -> bool:
    if layer.mla is not None or layer.moe is not None or layer.qk_norm is not None or layer.gate_up is None:
        return False
    return all(_c_weight(w) is not None for w in _linears(layer))


def fused_layers(model: DecoderModel, cache: PagedKVCache, phase: str = "decode") -> DecodeLayers | None:
    """The model's `phase` layers ("decode" or "prefill") over `cache` as one C call, or None where the
    model, the cache or this host does not take it (module docstring). Built on first use per cache and
    phase and kept on the model."""
    if not model.fused_decode:
        return None
    held = model.fused_for_cache
    if held is None or held[0] is not cache:
        held = model.fused_for_cache = (cache, {})
    if phase not in held[1]:
        held[1][phase] = _build(model, cache, model.phase_layers[phase])
    return held[1][phase]


def _build(model: DecoderModel, cache: Any, layers: list[Any]) -> DecodeLayers | None:
    dtype = model.dtype
    if (model.group is not None or dtype not in (torch.bfloat16, torch.float32)
            or model.embed.device.type != "cpu" or not all(_eligible_layer(layer) for layer in layers)
            or not hasattr(cache, "layer") or getattr(cache, "compute_dtype", None) != dtype
            or not cpu_decode_layers.available()
            or (dtype == torch.float32 and not cpu_decode_layers.float32_available())):
        return None
    kv = [cache.layer(i) for i in range(len(layers))]
    if any(k.k.dtype not in (dtype, torch.float8_e4m3fn) for k in kv):
        return None
    fp8 = kv[0].k.dtype == torch.float8_e4m3fn
    cfg = model.local_cfg
    next_norms = [layer.input_norm for layer in layers[1:]] + [None]
    tensors = [LayerTensors(*map(_c_weight, _linears(layer)), layer.post_norm, nxt, k.k, k.v,
                            k.k_scale if fp8 else None, k.v_scale if fp8 else None)
               for layer, nxt, k in zip(layers, next_norms, kv)]
    try:
        return DecodeLayers(tensors, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps)
    except ValueError:  # shapes or layouts the kernels do not take
        return None


def _max_rows(model: DecoderModel) -> int:
    """Rows up to which a step keeps its threads with the C kernels: the bfloat16 GEMV's limit, or the float32
    GEMV's for a float32 model."""
    return cpu_gemv_f32.max_rows() if model.dtype == torch.float32 else cpu_gemv.max_rows()


def runs_step(model: DecoderModel, rows: int, phase: str = "decode") -> bool:
    """Whether `rows` rows on the `phase` weights may run the fused call: every linear takes its C GEMV at
    that count (INT4 at any count; a step of more than `_max_rows` keeps torch's threads, so not there)."""
    linears = _linears(model.phase_layers[phase][0])
    return rows <= _max_rows(model) and all(w.takes_gemv(rows) for w in linears if isinstance(w, Linear))


def runs_split_step(model: DecoderModel, rows: int, split: int) -> bool:
    """Whether a step of `rows` rows over two formats, its first `split` on the decode weights and the rest on
    the prefill weights, may run as two fused calls: each part takes its C GEMVs, and the whole step stays
    within `_max_rows` (the engine keeps torch's threads for larger steps)."""
    return (rows <= _max_rows(model) and runs_step(model, split, "decode")
            and runs_step(model, rows - split, "prefill"))
