"""The paged latent KV cache: bytes per token from a config alone (Kimi K2.6, GLM-5 with its indexer),
the create_kv_cache dispatch, store/gather/read over every row format against the kernels' references,
and raw-row moves between pools of the same and of other formats."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from backend.config import ModelConfig
from backend.errors import InvalidRequest
from backend.kv_cache import create_kv_cache, kv_bytes_per_token, pages_for_budget
from backend.latent_kv_cache import LatentKVCache, LatentRows
from kernels.latent_kv_store import dequantize_latent_ref, quantize_latent_ref

FORMATS = ("fp32", "bf16", "fp8_e4m3")

KIMI_K26: dict[str, Any] = {  # moonshotai/Kimi-K2.6 config.json, the fields that size the cache
    "architectures": ["Kimi_K25ForConditionalGeneration"],
    "text_config": {"vocab_size": 163840, "hidden_size": 7168, "intermediate_size": 18432, "num_hidden_layers": 61,
                    "num_attention_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
                    "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 384, "num_experts_per_tok": 8,
                    "n_group": 1, "topk_group": 1, "moe_intermediate_size": 2048,
                    "max_position_embeddings": 262144}}

GLM5: dict[str, Any] = {"architectures": ["GlmMoeDsaForCausalLM"], "vocab_size": 154880, "hidden_size": 6144,
                        "intermediate_size": 12288, "num_hidden_layers": 78, "num_attention_heads": 64,
                        "n_routed_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 2048}


def tiny_cfg(kv_lora_rank: int = 136, rope: int = 8, layers: int = 2, **extra: Any) -> ModelConfig:
    """An MLA config whose latent spans two fp8 groups (136 = 128 + 8)."""
    return ModelConfig.from_dict({"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 64, "hidden_size": 32,
                                  "intermediate_size": 64, "num_hidden_layers": layers, "num_attention_heads": 2,
                                  "kv_lora_rank": kv_lora_rank, "qk_rope_head_dim": rope, "qk_nope_head_dim": 8,
                                  "v_head_dim": 8, "q_lora_rank": None, **extra})


def test_bytes_per_token_from_a_config_alone() -> None:
    kimi = ModelConfig.from_dict(KIMI_K26)
    assert [kv_bytes_per_token(kimi, f) for f in FORMATS] == [140_544, 70_272, 40_016]  # 61 x (2304, 1152, 656)
    tokens = pages_for_budget(kimi, "bf16", int(46.8 * 2**30), 16) * 16
    assert 715_000 < tokens <= 715_088  # the vLLM recipe log: 715,072 tokens in 46.8 GiB
    glm5 = ModelConfig.from_dict(GLM5)  # + the DSA indexer's 128 e4m3 + 1 fp32 scale per layer
    assert [kv_bytes_per_token(glm5, f) for f in ("bf16", "fp8_e4m3")] == [78 * (1152 + 132), 78 * (656 + 132)]


def test_create_kv_cache_gives_latent_pages_for_mla_and_refuses_bad_fp8_dims() -> None:
    cfg = tiny_cfg()
    cache = create_kv_cache(cfg, "fp8_e4m3", 10 * 16 * kv_bytes_per_token(cfg, "fp8_e4m3") + 5, 16, torch.float32)
    assert isinstance(cache, LatentKVCache) and cache.num_pages == 10
    assert cache.pages.shape == (2, 10, 16, 136 + 4 * 2 + 2 * 8) and cache.pages.dtype == torch.uint8
    assert cache.total_bytes == 10 * 16 * cache.bytes_per_token and cache.geometry.head_dim == 144
    with pytest.raises(InvalidRequest):
        create_kv_cache(tiny_cfg(kv_lora_rank=30), "fp8_e4m3", 2**20, 16, torch.float32)
    with pytest.raises(InvalidRequest):
        create_kv_cache(cfg, "int8", 2**20, 16, torch.float32)


@pytest.mark.parametrize("kv_format", FORMATS)
def test_store_then_gather_and_read_match_the_reference_rows(kv_format: str) -> None:
    cfg = tiny_cfg()
    cache = LatentKVCache(cfg, kv_format, 6, 4, torch.float32)
    before = cache.pages.clone()
    slots = torch.tensor([5, 6, 7, 8, 21, 0])  # across pages 1, 2, 5, 0
    latent, k_pe = torch.randn(6, 136) * 3, torch.randn(6, 8)
    cache.store(1, slots, latent, k_pe)
    assert torch.equal(cache.pages[0], before[0])  # the other layer is untouched
    written = torch.zeros(6 * 4, dtype=torch.bool)
    written[slots] = True
    flat = cache.pages[1].reshape(24, -1)
    assert torch.equal(flat[~written], before[1].reshape(24, -1)[~written])  # and so are the other slots
    want_latent, want_pe = dequantize_latent_ref(quantize_latent_ref(latent, k_pe, kv_format), 136, 8, kv_format,
                                                 torch.float32)
    got_latent, got_pe = cache.read_tokens(1, slots)
    assert torch.equal(got_latent, want_latent) and torch.equal(got_pe, want_pe)
    if kv_format == "fp32":
        assert torch.equal(got_latent, latent) and torch.equal(got_pe, k_pe)
    table = torch.tensor([[1, 2], [5, 0]])  # slots 4..11 and 20..23, 0..3
    rows = cache.gather(1, table)  # [2, 8, 144]
    assert rows.shape == (2, 8, 144)
    assert torch.equal(rows[0, 1:4], torch.cat([want_latent, want_pe], -1)[:3])
    assert torch.equal(rows[1, 1], torch.cat([want_latent[4], want_pe[4]]))
    assert torch.equal(rows[1, 4], torch.cat([want_latent[5], want_pe[5]]))


@pytest.mark.parametrize("src", FORMATS)
@pytest.mark.parametrize("dst", FORMATS)
def test_raw_rows_move_byte_for_byte_or_restored_in_the_other_format(src: str, dst: str) -> None:
    cfg = tiny_cfg()
    a, b = LatentKVCache(cfg, src, 4, 4, torch.float32), LatentKVCache(cfg, dst, 5, 4, torch.float32)
    latent, k_pe = torch.randn(7, 136), torch.randn(7, 8)
    a.store(0, torch.arange(7), latent, k_pe)
    rows = a.read_rows(0, torch.arange(7))
    assert rows.kv_format == src and rows.index_rows is None
    b.write_rows(0, torch.arange(10, 17), rows)
    got = b.read_rows(0, torch.arange(10, 17)).rows
    if src == dst:
        assert torch.equal(got, rows.rows)
    else:  # the sender's values, dequantised, stored in the receiver's format
        values = dequantize_latent_ref(rows.rows, 136, 8, src, torch.float32)
        assert torch.equal(got, quantize_latent_ref(*values, dst))


def test_rows_of_another_geometry_are_refused() -> None:
    a, b = LatentKVCache(tiny_cfg(), "bf16", 2, 4, torch.float32), LatentKVCache(tiny_cfg(128), "bf16", 2, 4,
                                                                                   torch.float32)
    rows = a.read_rows(0, torch.arange(3))
    with pytest.raises(InvalidRequest):
        b.write_rows(0, torch.arange(3), rows)
    with pytest.raises(InvalidRequest):
        a.write_rows(0, torch.arange(3), LatentRows(rows.rows[:, :-1], "bf16", 136, 8))
