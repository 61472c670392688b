"""IndexerKeyCache: the DSA indexer's paged FP8 key cache (one e4m3 row + one fp32 scale per token)."""

from __future__ import annotations

import pytest
import torch

from backend.config import ModelConfig
from backend.errors import InvalidRequest
from backend.indexer_cache import IndexerKeyCache, dequantize_index_keys, quantize_index_keys


def dsa_cfg(index_head_dim: int = 32, num_layers: int = 2) -> ModelConfig:
    return ModelConfig.from_dict(dict(
        architectures=["GlmMoeDsaForCausalLM"], vocab_size=64, hidden_size=32, intermediate_size=64,
        num_hidden_layers=num_layers, num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8, index_topk=4, index_head_dim=index_head_dim, index_n_heads=2,
        max_position_embeddings=64))


def test_bytes_per_token_glm5() -> None:
    glm5 = ModelConfig.from_dict(dict(architectures=["GlmMoeDsaForCausalLM"], vocab_size=154880,
                                      hidden_size=6144, intermediate_size=12288, num_hidden_layers=78,
                                      num_attention_heads=64))
    assert IndexerKeyCache.bytes_per_token_per_layer(glm5) == 132
    # GLM-5's published indexer bytes per token, its 78 layers together
    assert IndexerKeyCache.bytes_per_token_per_layer(glm5) * 78 == 10_296
    assert IndexerKeyCache.bytes_per_token_per_layer(glm5, "fp32") == 512


def test_quantise_format_by_hand() -> None:
    k = torch.randn(5, 32) * torch.rand(5, 1) * 10
    k[2] = 0.0
    rows = quantize_index_keys(k)
    assert rows.shape == (5, 36) and rows.dtype == torch.uint8
    scale = rows[:, 32:].contiguous().view(torch.float32).squeeze(1)
    amax = k.abs().amax(-1)
    torch.testing.assert_close(scale, torch.where(amax > 0, amax / 448, torch.ones_like(amax)), rtol=0, atol=0)
    values = rows[:, :32].contiguous().view(torch.float8_e4m3fn).float()
    assert values[[0, 1, 3, 4]].abs().amax(-1).eq(448).all()  # each token's largest value maps to 448
    assert values[2].eq(0).all()
    back = dequantize_index_keys(rows, 32)
    # e4m3 keeps 3 mantissa bits: relative error <= 2**-4 of each value (above the subnormal range)
    big = k.abs() > amax.unsqueeze(1) / 2**6
    assert ((back - k).abs()[big] <= k.abs()[big] * 2**-4 + 1e-7).all()


@pytest.mark.parametrize("key_format", ["fp8_e4m3", "fp32"])
def test_store_gather_round_trip(key_format: str) -> None:
    torch.manual_seed(0)
    cfg = dsa_cfg()
    cache = IndexerKeyCache(cfg, num_pages=6, page_size=4, key_format=key_format)
    page_table = torch.tensor([[4, 1, 5], [2, 0, 0]], dtype=torch.int32)
    lens = [10, 3]
    keys = [torch.randn(n, 32) * 3 for n in lens]
    for b, n in enumerate(lens):
        pos = torch.arange(n)
        slots = page_table[b].long()[pos // 4] * 4 + pos % 4
        cache.store(1, slots, keys[b])
    out = cache.gather(1, page_table)
    assert out.shape == (2, 12, 32) and out.dtype == torch.float32
    for b, n in enumerate(lens):
        expect = keys[b] if key_format == "fp32" else dequantize_index_keys(quantize_index_keys(keys[b]), 32)
        torch.testing.assert_close(out[b, :n], expect, rtol=0, atol=0)
    assert cache.gather(0, page_table).eq(0).all()  # the other layer untouched


def test_transfer_rows_byte_for_byte() -> None:
    torch.manual_seed(1)
    cfg = dsa_cfg()
    src = IndexerKeyCache(cfg, num_pages=4, page_size=4)
    dst = IndexerKeyCache(cfg, num_pages=8, page_size=4)
    k = torch.randn(7, 32)
    src_slots = torch.tensor([0, 1, 2, 3, 8, 9, 10])
    src.store(0, src_slots, k)
    rows = src.read_tokens(0, src_slots)
    dst_slots = torch.tensor([20, 21, 22, 23, 4, 5, 6])
    dst.write_tokens(0, dst_slots, rows)
    assert torch.equal(dst.read_tokens(0, dst_slots), rows)
    got = dst.gather(0, torch.tensor([[5, 1]]))[0, :7]
    torch.testing.assert_close(got, dequantize_index_keys(quantize_index_keys(k), 32), rtol=0, atol=0)


def test_bad_inputs_are_typed_errors() -> None:
    cfg = dsa_cfg()
    cache = IndexerKeyCache(cfg, num_pages=2, page_size=4)
    with pytest.raises(InvalidRequest):
        cache.store(0, torch.tensor([0, 1]), torch.randn(2, 16))
    with pytest.raises(InvalidRequest):
        cache.store(0, torch.tensor([0, 1], dtype=torch.int32), torch.randn(2, 32))
    with pytest.raises(InvalidRequest):
        cache.write_tokens(0, torch.tensor([0]), torch.zeros(1, 132, dtype=torch.uint8))
    with pytest.raises(InvalidRequest):
        IndexerKeyCache(cfg, 2, 4, key_format="bf16")
