"""The architecture registry and the shared layers it wires: config parsing per family,
refusal of unknown architectures, and partial RoPE equal to the reference's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from backend.config import SUPPORTED_ARCHITECTURES, ModelConfig
from backend.engine import EngineConfig, LLMEngine
from backend.errors import UnsupportedArchitecture
from backend.model import DecoderModel, LlamaModel
from backend.models import ARCHITECTURES
from backend.rope import RotaryEmbedding, interleave_rope_rows
from tests.backend.tiny_models import write_tiny_model

# GLM-4.6's config.json as published (fields the runtime reads; partial_rotary_factor top-level)
GLM46 = {"architectures": ["Glm4MoeForCausalLM"], "vocab_size": 151552, "hidden_size": 5120, "head_dim": 128,
         "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_hidden_layers": 92,
         "num_attention_heads": 96, "num_key_value_heads": 8, "n_routed_experts": 160, "num_experts_per_tok": 8,
         "n_shared_experts": 1, "first_k_dense_replace": 3, "routed_scaling_factor": 2.5, "use_qk_norm": True,
         "attention_bias": True, "partial_rotary_factor": 0.5, "rope_theta": 1000000, "n_group": 1,
         "topk_group": 1, "norm_topk_prob": True, "max_position_embeddings": 202752, "rms_norm_eps": 1e-5,
         "num_nextn_predict_layers": 1, "eos_token_id": [151329, 151336, 151338]}


def test_glm46_config_is_read_with_its_moe_and_attention_fields() -> None:
    cfg = ModelConfig.from_dict(GLM46)
    assert (cfg.architecture, cfg.head_dim, cfg.rotary_dim) == ("Glm4MoeForCausalLM", 128, 64)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.n_shared_experts) == (
        160, 8, 1536, 1)
    assert cfg.use_qk_norm and cfg.attention_bias and cfg.routed_scaling_factor == 2.5
    assert [cfg.is_moe_layer(i) for i in (0, 2, 3, 91)] == [False, False, True, True]
    assert cfg.num_nextn_predict_layers == 1 and cfg.eos_token_ids == (151329, 151336, 151338)


def test_family_defaults_fill_absent_fields() -> None:
    """Glm4MoeConfig defaults partial_rotary_factor to 0.5 and attention_bias off; Qwen2 has biases."""
    sparse = {k: v for k, v in GLM46.items() if k not in ("partial_rotary_factor", "attention_bias",
                                                          "first_k_dense_replace")}
    cfg = ModelConfig.from_dict(sparse)
    assert (cfg.partial_rotary_factor, cfg.attention_bias, cfg.first_k_dense_replace) == (0.5, False, 1)
    v5 = {**sparse, "rope_parameters": {"rope_theta": 1e6, "rope_type": "default", "partial_rotary_factor": 1.0}}
    assert ModelConfig.from_dict(v5).rotary_dim == 128  # transformers v5 keeps it in rope_parameters
    qwen = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 10, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 4}
    q = ModelConfig.from_dict(qwen)
    assert q.attention_bias and q.rotary_dim == q.head_dim == 8 and q.num_experts == 0 and not q.is_moe_layer(0)


def test_architectures_0_picks_the_module_and_unknown_ones_are_named() -> None:
    assert set(SUPPORTED_ARCHITECTURES) == set(ARCHITECTURES) >= {"LlamaForCausalLM", "Qwen2ForCausalLM",
                                                                   "Glm4MoeForCausalLM"}
    with pytest.raises(UnsupportedArchitecture) as err:  # a supported name later in the list does not count
        ModelConfig.from_dict({**GLM46, "architectures": ["MixtralForCausalLM", "Glm4MoeForCausalLM"]})
    assert "MixtralForCausalLM" in err.value.message
    assert all(a in err.value.message for a in ARCHITECTURES)


def test_llama_model_name_still_loads_through_the_registry(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "m", "qwen2", seed=5)
    assert LlamaModel is DecoderModel
    direct = LlamaModel.from_pretrained(path)
    engine = LLMEngine.from_pretrained(path, EngineConfig(dtype="float32", kv_format="fp32", kv_cache_bytes=2**20))
    assert direct.cfg == engine.model.cfg
    ours, theirs = direct.phase_layers["prefill"][1], engine.model.phase_layers["prefill"][1]
    torch.testing.assert_close(ours.qkv.weight, theirs.qkv.weight, rtol=0, atol=0)


@pytest.mark.parametrize("factor", [0.5, 0.25, 1.0])
def test_partial_rope_on_interleaved_rows_matches_transformers(factor: float) -> None:
    """Our rows reordered at load + complex rotation == transformers' rotate-half on the first
    rotary_dim dims (pass-through after), up to the same reordering of the output."""
    from transformers.models.glm4_moe.modeling_glm4_moe import apply_rotary_pos_emb

    heads, hd, t = 3, 24, 37
    cfg = ModelConfig.from_dict({**GLM46, "head_dim": hd, "num_attention_heads": heads, "num_key_value_heads": 1,
                                 "hidden_size": heads * hd, "partial_rotary_factor": factor, "rope_theta": 500.0,
                                 "max_position_embeddings": 1100})
    rot = cfg.rotary_dim
    positions = torch.randint(0, 1100, (t,))
    q = torch.randn(t, heads, hd) * 3.0
    inv_freq = 1.0 / (500.0 ** (torch.arange(0, rot, 2).float() / rot))
    emb = torch.cat([positions[:, None].float() * inv_freq] * 2, dim=-1)  # [T, rot]
    want, _ = apply_rotary_pos_emb(q.transpose(0, 1)[None], q.transpose(0, 1)[None], emb.cos()[None], emb.sin()[None])
    want = want[0].transpose(0, 1)  # [T, heads, hd]
    perm = interleave_rope_rows(torch.arange(hd), 1, hd, rot)
    assert perm[rot:].tolist() == list(range(rot, hd))  # pass-through dims stay in place
    rope = RotaryEmbedding(cfg)
    got = RotaryEmbedding.apply(q[..., perm], rope.tables(positions))
    torch.testing.assert_close(got, want[..., perm], rtol=1e-5, atol=1e-5)
    if rot < hd:
        assert torch.equal(got[..., rot:], q[..., rot:])
