"""The `--ignore` list: compressed-tensors' matching (exact names, `re:` from the start of the name),
the documented defaults and the Kimi preset on real layer names, and fused shards that must agree."""

from __future__ import annotations

import pytest

from backend.config import ModelConfig
from backend.errors import InvalidRequest
from backend.models.checkpoint_layout import checkpoint_layout
from ops.model_configs import known_config
from ops.quantize_ignore import (DEFAULT_IGNORE, KIMI_IGNORE, check_fused_consistency, fused_group,
                                 ignore_patterns, is_ignored, validate_patterns)

L = "model.layers.5."


def test_names_match_exactly_and_regexes_from_the_start() -> None:
    assert is_ignored("lm_head", ["lm_head"]) and not is_ignored("model.lm_head", ["lm_head"])
    assert not is_ignored("lm_head_extra", ["lm_head"])
    assert is_ignored(f"{L}mlp.gate", [r"re:.*mlp\.gate$"])
    assert not is_ignored(f"{L}mlp.gate_proj", [r"re:.*mlp\.gate$"])
    assert not is_ignored(f"{L}mlp.gate", [r"re:mlp\.gate$"])  # re.match: anchored at the start, not search
    assert is_ignored("language_model.lm_head", ["language_model.lm_head"])
    assert is_ignored("lm_head", ["language_model.lm_head"], prefix="language_model.")  # Kimi's spelling
    assert not is_ignored("lm_head", [])


@pytest.mark.parametrize("name, default, kimi", [
    ("lm_head", True, True),
    ("model.embed_tokens", True, True),
    ("model.norm", True, True),
    (f"{L}input_layernorm", True, True),
    (f"{L}self_attn.kv_a_layernorm", True, True),
    (f"{L}self_attn.indexer.k_norm", True, True),
    (f"{L}mlp.gate", True, True),  # the router
    (f"{L}self_attn.kv_b_proj", True, True),  # dequantised at load for weight absorption
    (f"{L}self_attn.indexer.wq_b", True, True),
    (f"{L}self_attn.indexer.weights_proj", True, True),
    ("model.layers.78.eh_proj", True, True),  # MTP: a plain nn.Linear in vLLM and SGLang
    (f"{L}self_attn.q_a_proj", False, True),
    (f"{L}self_attn.o_proj", False, True),
    (f"{L}self_attn.q_proj", False, True),
    ("model.layers.0.mlp.gate_proj", False, True),  # a dense first layer's MLP
    ("model.layers.0.mlp.down_proj", False, True),
    (f"{L}mlp.shared_experts.up_proj", False, True),
    (f"{L}mlp.experts.17.gate_proj", False, False),  # routed experts: INT4 under both
    (f"{L}mlp.experts.255.down_proj", False, False),
])
def test_defaults_and_the_kimi_preset(name: str, default: bool, kimi: bool) -> None:
    assert is_ignored(name, DEFAULT_IGNORE) is default
    assert is_ignored(name, KIMI_IGNORE) is kimi
    assert is_ignored(name, ignore_patterns("kimi")) is kimi


def test_the_kimi_preset_holds_kimis_own_list_and_leaves_only_routed_experts() -> None:
    shipped = known_config("kimi-k2.6")["quantization_config"]["ignore"]
    assert set(shipped) <= set(KIMI_IGNORE) and set(DEFAULT_IGNORE) <= set(KIMI_IGNORE)
    cfg = ModelConfig.from_dict({**known_config("deepseek-v3"), "num_hidden_layers": 5, "n_routed_experts": 8,
                                 "n_group": 1, "topk_group": 1})
    quantised = [m for m in checkpoint_layout(cfg).linears if not is_ignored(m, KIMI_IGNORE)]
    assert quantised and all(".mlp.experts." in m for m in quantised)
    assert len(quantised) == (5 - cfg.first_k_dense_replace) * 8 * 3


def test_presets_and_extra_patterns() -> None:
    assert ignore_patterns() == DEFAULT_IGNORE
    assert ignore_patterns("none") == ()
    assert ignore_patterns("none", [r"re:.*o_proj$", "lm_head", "lm_head"]) == (r"re:.*o_proj$", "lm_head")
    assert ignore_patterns("default", ["lm_head"]) == DEFAULT_IGNORE  # duplicates dropped, order kept
    with pytest.raises(InvalidRequest, match="unknown ignore preset 'awq'; known: default, kimi, none"):
        ignore_patterns("awq")


@pytest.mark.parametrize("bad, match", [("re:(", "not a valid regex"), ("", "empty"), ("re:", "empty"),
                                        ("  ", "empty")])
def test_bad_patterns_are_invalid_requests_naming_them(bad: str, match: str) -> None:
    with pytest.raises(InvalidRequest, match=match):
        validate_patterns(["lm_head", bad])


def test_fused_groups_are_vllms() -> None:
    assert fused_group(f"{L}self_attn.k_proj") == f"{L}self_attn.qkv_proj"
    assert fused_group(f"{L}self_attn.kv_a_proj_with_mqa") == f"{L}self_attn.fused_qkv_a_proj"
    assert fused_group(f"{L}mlp.up_proj") == f"{L}mlp.gate_up_proj"
    assert fused_group(f"{L}mlp.shared_experts.gate_proj") == f"{L}mlp.shared_experts.gate_up_proj"
    assert fused_group(f"{L}mlp.experts.3.down_proj") == f"{L}mlp.experts"
    assert fused_group(f"{L}self_attn.o_proj") is None and fused_group(f"{L}mlp.down_proj") is None


def test_an_ignore_list_that_splits_a_fused_module_is_refused() -> None:
    glm = ModelConfig.from_dict({**known_config("glm-4.6"), "num_hidden_layers": 4, "n_routed_experts": 4,
                                 "num_experts_per_tok": 2})
    linears = checkpoint_layout(glm).linears
    for ok in (DEFAULT_IGNORE, KIMI_IGNORE, [r"re:.*self_attn\.(q|k|v)_proj$"], [r"re:.*layers\.3\.mlp\.experts\."]):
        check_fused_consistency(linears, ok)
    with pytest.raises(InvalidRequest, match=r"model\.layers\.0\.self_attn\.q_proj .* model\.layers\.0\.self_attn"
                                             r"\.k_proj.*qkv_proj"):
        check_fused_consistency(linears, [r"re:.*q_proj$"])
    with pytest.raises(InvalidRequest, match=r"model\.layers\.3\.mlp\.experts\b"):
        check_fused_consistency(linears, [r"re:.*experts\.2\."])
    with pytest.raises(InvalidRequest, match=r"gate_up_proj"):
        check_fused_consistency(linears, [r"re:.*mlp\.up_proj$"])
