"""Tiny random DeepseekV3 (MLA + MoE) checkpoints written by `transformers` (test helper, not a test)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.backend.tiny_models import make_decisive

DEEPSEEK_V3_TINY: dict[str, Any] = dict(
    vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2,
    topk_group=1, first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=1.5, rope_interleave=True,
    attention_bias=False, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=2, num_nextn_predict_layers=0)

YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "mscale": 1.0,
        "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}


def write_tiny_deepseek_v3(path: Path, seed: int = 0, yarn: bool = False, **overrides: Any) -> Path:
    """Save a random float32 `DeepseekV3ForCausalLM` (`DEEPSEEK_V3_TINY` with `overrides`; `yarn`:
    YaRN rope scaling with mscale_all_dim) to `path`. Weights are scaled up from transformers' 0.02
    init so attention and the router are decisive; the correction bias is small and positive."""
    import transformers

    torch.manual_seed(seed)
    kwargs = {**DEEPSEEK_V3_TINY, **overrides}
    if yarn:
        kwargs["rope_parameters"] = {"rope_theta": 10000.0, **YARN}
    cfg = transformers.DeepseekV3Config(**kwargs)
    model = transformers.DeepseekV3ForCausalLM(cfg)
    make_decisive(model, attention_std=0.12)
    model.eval().save_pretrained(path, safe_serialization=True)
    return path
