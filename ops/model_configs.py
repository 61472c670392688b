"""The published `config.json` of the large models edgeserve plans for, so sizing needs no download.

`edgeserve kv-budget kimi-k2.6` reads the figures it needs (layers, the latent and
RoPE widths, KV heads, the indexer) from these dicts; any `config.json` path works
the same way (`load_model_config`). Each dict holds the fields of the model card's
config.json that `backend.config.ModelConfig.from_dict` reads, with the values the
card publishes (auto_map, initializer and training-only fields are left out; the
quantization_config blocks are kept short: only what says how weights are stored).

Sources (the `config.json` on each Hugging Face model card):
- Kimi K2.6: https://huggingface.co/moonshotai/Kimi-K2.6/blob/main/config.json
  (`Kimi_K25ForConditionalGeneration`, a MoonViT vision tower plus a `kimi_k2`
  = DeepseekV3 `text_config`; the same architecture as K2.5, only `eos_token_id`
  moved from 163585 to 163586).
- DeepSeek-V3: https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json
- GLM-5: https://huggingface.co/zai-org/GLM-5/blob/main/config.json
  (`GlmMoeDsaForCausalLM`: MLA plus the DeepSeek sparse attention indexer).
- GLM-4.6: https://huggingface.co/zai-org/GLM-4.6/blob/main/config.json
  (`Glm4MoeForCausalLM`: grouped-query attention, 8 KV heads of 128).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from backend.config import ModelConfig
from backend.errors import ModelLoadError, ModelNotFound

__all__ = ["KNOWN_CONFIGS", "known_config", "read_config", "load_model_config"]

# Kimi K2.5 / K2.6 text backbone (moonshotai/Kimi-K2.6 config.json, "text_config")
_KIMI_K26_TEXT: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "kimi_k2",
    "vocab_size": 163840,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 384,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.827,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "hidden_act": "silu",
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-5,
    "rope_theta": 50000.0,
    "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                     "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 1.0, "beta_slow": 1.0},
    "attention_bias": False,
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 0,
    "bos_token_id": 163584,
    "eos_token_id": 163586,
    "torch_dtype": "bfloat16",
}

KNOWN_CONFIGS: dict[str, dict[str, Any]] = {
    # moonshotai/Kimi-K2.6: routed experts ship as compressed-tensors INT4 (group 32, symmetric)
    "kimi-k2.6": {
        "architectures": ["Kimi_K25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": _KIMI_K26_TEXT,
        "bos_token_id": 163584,
        "eos_token_id": 163586,
        "quantization_config": {
            "quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {
                "targets": ["Linear"], "input_activations": None,
                "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32,
                            "symmetric": True, "dynamic": False, "actorder": None}}},
            "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                       "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]},
    },
    # deepseek-ai/DeepSeek-V3: 128x128 block-scaled FP8 weights
    "deepseek-v3": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": 129280,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
        "moe_layer_freq": 1,
        "n_group": 8,
        "topk_group": 4,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "hidden_act": "silu",
        "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                         "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
        "attention_bias": False,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": 1,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                "weight_block_size": [128, 128]},
    },
    # zai-org/GLM-5: MLA + DSA lightning indexer (128-dim keys, 32 heads, top-2048)
    "glm-5": {
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
        "vocab_size": 154880,
        "hidden_size": 6144,
        "intermediate_size": 12288,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 78,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "q_lora_rank": 2048,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 192,
        "qk_rope_head_dim": 64,
        "v_head_dim": 256,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
        "moe_layer_freq": 1,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "hidden_act": "silu",
        "index_topk": 2048,
        "index_head_dim": 128,
        "index_n_heads": 32,
        "indexer_rope_interleave": True,
        "rope_interleave": True,
        "max_position_embeddings": 202752,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "attention_bias": False,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": 1,
        "bos_token_id": 0,
        "eos_token_id": [154820, 154827, 154829],
        "torch_dtype": "bfloat16",
    },
    # zai-org/GLM-4.6: GQA 96 query / 8 KV heads of 128, partial RoPE (half of each head)
    "glm-4.6": {
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": "glm4_moe",
        "vocab_size": 151552,
        "hidden_size": 5120,
        "intermediate_size": 12288,
        "moe_intermediate_size": 1536,
        "num_hidden_layers": 92,
        "num_attention_heads": 96,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "partial_rotary_factor": 0.5,
        "n_routed_experts": 160,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "use_qk_norm": True,
        "attention_bias": True,
        "hidden_act": "silu",
        "max_position_embeddings": 202752,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": 1,
        "eos_token_id": [151329, 151336, 151338],
        "pad_token_id": 151329,
        "torch_dtype": "bfloat16",
    },
}


def known_config(name: str) -> dict[str, Any]:
    """A copy of the published config.json of `name` (case-insensitive, one of KNOWN_CONFIGS)."""
    raw = KNOWN_CONFIGS.get(name.strip().lower())
    if raw is None:
        raise ModelNotFound(f"unknown model {name!r}: give a config.json path or one of "
                            f"{', '.join(KNOWN_CONFIGS)}", model=name, known=list(KNOWN_CONFIGS))
    return copy.deepcopy(raw)


def read_config(name_or_path: str | Path) -> tuple[str, dict[str, Any]]:
    """(label, parsed config.json) for a known model name, a config.json path or a folder holding one.

    A path that exists is read (ModelLoadError if it cannot be read or is not a JSON object);
    otherwise the argument must be a known name (ModelNotFound naming them)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        if isinstance(name_or_path, Path) or "/" in str(name_or_path) or str(name_or_path).endswith(".json"):
            raise ModelLoadError(f"no such config file: {path}", path=str(path))
        return str(name_or_path).strip().lower(), known_config(str(name_or_path))
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}", path=str(path)) from exc
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}", path=str(path)) from exc
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path} is not a JSON object", path=str(path))
    label = path.parent.name if path.name == "config.json" and path.parent.name else path.stem
    return label, raw


def load_model_config(name_or_path: str | Path) -> tuple[str, ModelConfig]:
    """(label, validated ModelConfig) for a known model name or a config.json path (see `read_config`)."""
    label, raw = read_config(name_or_path)
    return label, ModelConfig.from_dict(raw)
