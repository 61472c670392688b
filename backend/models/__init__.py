"""The architecture registry: `architectures[0]` of config.json -> the module that wires it.

Each architecture is one short module under `backend/models/` with a
`load_layers(loader) -> {format: [LayerWeights]}` function (see
`backend/models/llama.py`) assembled from the shared pieces in `backend/layers/`.
The table below is the one place an architecture name is recognised: `config.py`
validates config.json against it (an unknown name is refused with the supported
list) and fills in the fields the family's Hugging Face config class defaults, and
`backend.model.load_model` imports the module lazily, so reading a config never
imports model code.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, NamedTuple

__all__ = ["ARCHITECTURES", "Architecture", "architecture_module"]


class Architecture(NamedTuple):
    module: str  # dotted path of the module with `load_layers(loader)`
    config_defaults: dict[str, Any]  # config.json fields the family's HF config class defaults when absent


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture("backend.models.llama", {"attention_bias": False}),
    "Qwen2ForCausalLM": Architecture("backend.models.llama", {"attention_bias": True}),
    # transformers' Glm4MoeConfig defaults (partial_rotary_factor 0.5 "for backward compatibility")
    "Glm4MoeForCausalLM": Architecture("backend.models.glm4_moe", {
        "attention_bias": False, "partial_rotary_factor": 0.5, "use_qk_norm": False, "n_group": 1,
        "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.0, "first_k_dense_replace": 1,
        "n_shared_experts": 1, "num_nextn_predict_layers": 0}),
    # transformers' DeepseekV3Config defaults; Kimi K2.5/K2.6 wrap the same text model
    "DeepseekV3ForCausalLM": Architecture("backend.models.deepseek_v3", _DEEPSEEK_V3 := {
        "attention_bias": False, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "n_group": 8, "topk_group": 4, "norm_topk_prob": True,
        "routed_scaling_factor": 2.5, "first_k_dense_replace": 3, "n_shared_experts": 1, "rope_interleave": True,
        "num_nextn_predict_layers": 0}),
    "Kimi_K25ForConditionalGeneration": Architecture("backend.models.deepseek_v3", _DEEPSEEK_V3),
    # transformers' GlmMoeDsaConfig defaults (MLA and the indexer always interleave RoPE)
    "GlmMoeDsaForCausalLM": Architecture("backend.models.glm_moe_dsa", {
        "attention_bias": False, "q_lora_rank": 2048, "kv_lora_rank": 512, "qk_nope_head_dim": 192,
        "qk_rope_head_dim": 64, "v_head_dim": 256, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
        "routed_scaling_factor": 2.5, "first_k_dense_replace": 3, "n_shared_experts": 1, "rope_interleave": True,
        "indexer_rope_interleave": True, "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32,
        "num_nextn_predict_layers": 0}),
}


def architecture_module(name: str) -> ModuleType:
    """The wiring module registered for architecture `name` (already validated by config.py)."""
    return importlib.import_module(ARCHITECTURES[name].module)
