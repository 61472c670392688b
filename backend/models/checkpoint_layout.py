"""Which checkpoint tensors an architecture's layers read, by role, without loading anything.

Tools that rewrite a checkpoint tensor by tensor (`edgeserve quantize`) need to know
which tensors are linear weights (converted to another weight format) and which
dense tensors the runtime cannot do without (checked before anything is written).
Both follow from the architecture and its config, so they are stated here, per
architecture module of the registry (`backend/models/__init__.py`), next to the
wiring they describe:

    GQA decoders (Llama, Qwen2, Glm4Moe), per layer i below num_hidden_layers, `model.layers.{i}.`:
      linears  self_attn.{q,k,v,o}_proj
               dense layer (every layer of a dense model; i < first_k_dense_replace of a MoE one):
                 mlp.{gate,up,down}_proj
               MoE layer: mlp.experts.{j}.{gate,up,down}_proj for j < n_routed_experts, and
                 mlp.shared_experts.{gate,up,down}_proj when n_shared_experts > 0
      dense    input_layernorm.weight, post_attention_layernorm.weight,
               self_attn.{q,k}_norm.weight (use_qk_norm), mlp.gate.weight (MoE layers: the router)
    and model.embed_tokens.weight, model.norm.weight.

    MLA decoders (DeepseekV3, Kimi K2.x), per layer: the MLP part as above, and
      linears  self_attn.{q_a_proj, q_b_proj} (q_lora_rank set) or self_attn.q_proj,
               self_attn.{kv_a_proj_with_mqa, kv_b_proj, o_proj}
               (kv_b_proj is dequantised at load whatever its format: weight absorption needs it dense)
      dense    input_layernorm.weight, post_attention_layernorm.weight,
               self_attn.kv_a_layernorm.weight, self_attn.q_a_layernorm.weight (q_lora_rank set)

    GlmMoeDsa (GLM-5.x): the MLA decoder, and on each layer whose indexer_types entry is "full"
      linears  self_attn.indexer.{wq_b, wk}
      dense    self_attn.indexer.k_norm.{weight, bias}, self_attn.indexer.weights_proj.weight
               (weights_proj stays dense, as GLM-5-FP8 ships it: its scores pick the top-k keys)

Everything else a checkpoint holds (biases, the router's `e_score_correction_bias`,
the LM head, multi-token-prediction layers stored as `model.layers.{num_hidden_layers}.*`)
is optional here: the loader reads what it finds, and rewriting tools copy it as
stored. The router is never a linear of this list: it stays float32 (`backend/moe.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from backend.config import ModelConfig
from backend.errors import UnsupportedArchitecture
from backend.models import ARCHITECTURES

__all__ = ["CheckpointLayout", "checkpoint_layout"]

_SWIGLU = ("gate_proj", "up_proj", "down_proj")


class CheckpointLayout(NamedTuple):
    linears: list[str]  # linear modules `<m>` (tensors `<m>.weight`, or a quantised format's), in layer order
    required: list[str]  # dense tensors the runtime needs besides the linears


def _gqa_attention(cfg: ModelConfig, p: str) -> CheckpointLayout:
    linears = [f"{p}self_attn.{n}_proj" for n in ("q", "k", "v", "o")]
    required = [f"{p}self_attn.q_norm.weight", f"{p}self_attn.k_norm.weight"] if cfg.use_qk_norm else []
    return CheckpointLayout(linears, required)


def _mla_attention(cfg: ModelConfig, p: str) -> CheckpointLayout:
    a = f"{p}self_attn."
    q = [f"{a}q_a_proj", f"{a}q_b_proj"] if cfg.q_lora_rank else [f"{a}q_proj"]
    linears = [*q, f"{a}kv_a_proj_with_mqa", f"{a}kv_b_proj", f"{a}o_proj"]
    required = [f"{a}kv_a_layernorm.weight"] + ([f"{a}q_a_layernorm.weight"] if cfg.q_lora_rank else [])
    return CheckpointLayout(linears, required)


def _dsa_attention(cfg: ModelConfig, p: str) -> CheckpointLayout:
    mla = _mla_attention(cfg, p)
    if cfg.indexer_types[int(p.split(".")[2])] != "full":
        return mla
    x = f"{p}self_attn.indexer."
    return CheckpointLayout([*mla.linears, f"{x}wq_b", f"{x}wk"],
                            [*mla.required, f"{x}k_norm.weight", f"{x}k_norm.bias", f"{x}weights_proj.weight"])


def _gqa_decoder(cfg: ModelConfig) -> CheckpointLayout:
    """GQA attention and, per layer, a dense SwiGLU MLP or a MoE block (`cfg.is_moe_layer`)."""
    return _decoder(cfg, _gqa_attention)


def _mla_decoder(cfg: ModelConfig) -> CheckpointLayout:
    """Multi-head latent attention and, per layer, a dense SwiGLU MLP or a MoE block."""
    return _decoder(cfg, _mla_attention)


def _dsa_decoder(cfg: ModelConfig) -> CheckpointLayout:
    """Multi-head latent attention with the DSA indexer on its "full" layers, dense or MoE MLPs."""
    return _decoder(cfg, _dsa_attention)


def _decoder(cfg: ModelConfig, attention: Callable[[ModelConfig, str], CheckpointLayout]) -> CheckpointLayout:
    linears: list[str] = []
    required = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        attn = attention(cfg, p)
        linears += attn.linears
        required += [f"{p}input_layernorm.weight", f"{p}post_attention_layernorm.weight", *attn.required]
        if not cfg.is_moe_layer(i):
            linears += [f"{p}mlp.{n}" for n in _SWIGLU]
            continue
        required.append(f"{p}mlp.gate.weight")
        linears += [f"{p}mlp.experts.{j}.{n}" for j in range(cfg.num_experts) for n in _SWIGLU]
        if cfg.n_shared_experts:
            linears += [f"{p}mlp.shared_experts.{n}" for n in _SWIGLU]
    return CheckpointLayout(linears, required)


_LAYOUTS: dict[str, Callable[[ModelConfig], CheckpointLayout]] = {  # registry module -> its layout
    "backend.models.llama": _gqa_decoder,
    "backend.models.glm4_moe": _gqa_decoder,
    "backend.models.deepseek_v3": _mla_decoder,
    "backend.models.glm_moe_dsa": _dsa_decoder,
}


def checkpoint_layout(cfg: ModelConfig) -> CheckpointLayout:
    """The linear modules and required dense tensors of `cfg`'s architecture (see the module docstring)."""
    module = ARCHITECTURES[cfg.architecture].module
    if module not in _LAYOUTS:
        raise UnsupportedArchitecture(f"no checkpoint layout for {cfg.architecture} ({module}); add one to "
                                      f"backend/models/checkpoint_layout.py")
    return _LAYOUTS[module](cfg)
