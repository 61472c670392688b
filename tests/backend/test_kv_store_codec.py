"""Store objects of KV blocks: every pool format moves byte for byte through encode/decode into other
pages, and every kind of damage (payload, checksum, token ids, namespace, geometry, truncation) is refused."""

from __future__ import annotations

import random

import pytest
import torch

from backend.config import ModelConfig
from backend.kv_cache import PagedKVCache
from backend.kv_regions import pool_layout, pool_tensors
from backend.kv_store_codec import BlockRejected, block_layout, decode_block, encode_block, read_pages, write_pages
from backend.latent_kv_cache import LatentKVCache


def gqa_cfg() -> ModelConfig:
    return ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32,
                                  "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
                                  "num_key_value_heads": 2})


def dsa_cfg() -> ModelConfig:
    return ModelConfig.from_dict(dict(
        architectures=["GlmMoeDsaForCausalLM"], vocab_size=64, hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8, index_topk=4, index_head_dim=32, index_n_heads=2,
        max_position_embeddings=64))


def pools(kind: str, kv_format: str, num_pages: int) -> PagedKVCache | LatentKVCache:
    if kind == "gqa":
        return PagedKVCache(gqa_cfg(), kv_format, num_pages, 4, torch.float32)
    return LatentKVCache(dsa_cfg(), kv_format, num_pages, 4, torch.float32)


def randomise(cache: PagedKVCache | LatentKVCache) -> None:
    for t in pool_tensors(cache):
        u8 = t.view(torch.uint8)
        u8.copy_(torch.randint(0, 256, u8.shape, dtype=torch.uint8))


def page_bytes(cache: PagedKVCache | LatentKVCache, page: int) -> list[torch.Tensor]:
    """Every pool tensor's bytes of one page."""
    return [t.view(torch.uint8).select(2 if r.parts > 1 else 1, page).clone()
            for t, r in zip(pool_tensors(cache), pool_layout(cache).regions)]


@pytest.mark.parametrize("kind,kv_format", [("gqa", "fp32"), ("gqa", "bf16"), ("gqa", "fp8_e4m3"),
                                            ("latent", "fp8_e4m3"), ("latent", "bf16")])
def test_blocks_move_byte_for_byte_into_other_pages(kind: str, kv_format: str) -> None:
    src, dst = pools(kind, kv_format, 6), pools(kind, kv_format, 5)
    randomise(src)
    randomise(dst)
    untouched = page_bytes(dst, 1)
    layout = block_layout(src)
    assert layout == block_layout(dst)
    rows = read_pages(src, [3, 0])
    assert rows.shape == (2, layout.block_bytes)
    tokens = [[random.randrange(64) for _ in range(4)] for _ in range(2)]
    hashes = [random.randbytes(16) for _ in range(2)]
    objects = [encode_block("ns", h, t, layout, r) for h, t, r in zip(hashes, tokens, rows)]
    payloads = [decode_block(o, "ns", h, t, layout) for o, h, t in zip(objects, hashes, tokens)]
    write_pages(dst, [4, 2], payloads)
    for a, b in zip(page_bytes(src, 3), page_bytes(dst, 4)):
        assert torch.equal(a, b)
    for a, b in zip(page_bytes(src, 0), page_bytes(dst, 2)):
        assert torch.equal(a, b)
    for a, b in zip(untouched, page_bytes(dst, 1)):
        assert torch.equal(a, b)


def test_fp8_pages_carry_their_scales() -> None:
    src, dst = pools("gqa", "fp8_e4m3", 3), pools("gqa", "fp8_e4m3", 3)
    randomise(src)
    layout = block_layout(src)
    assert [r.name for r in layout.regions] == ["values", "scales"]
    obj = encode_block("ns", b"h" * 16, [1, 2, 3, 4], layout, read_pages(src, [1])[0])
    write_pages(dst, [0], [decode_block(obj, "ns", b"h" * 16, [1, 2, 3, 4], layout)])
    assert torch.equal(dst.scales[:, :, 0], src.scales[:, :, 1])
    assert torch.equal(dst.pages.view(torch.uint8)[:, :, 0], src.pages.view(torch.uint8)[:, :, 1])


def test_latent_pages_carry_the_indexer_keys() -> None:
    src, dst = pools("latent", "fp8_e4m3", 3), pools("latent", "fp8_e4m3", 3)
    randomise(src)
    layout = block_layout(src)
    assert [r.name for r in layout.regions] == ["latent", "index"]
    obj = encode_block("ns", b"h" * 16, [1, 2, 3, 4], layout, read_pages(src, [2])[0])
    write_pages(dst, [1], [decode_block(obj, "ns", b"h" * 16, [1, 2, 3, 4], layout)])
    assert torch.equal(dst.indexer.pages[:, 1], src.indexer.pages[:, 2])
    assert torch.equal(dst.pages[:, 1], src.pages[:, 2])


def damaged(obj: bytes, at: int) -> bytes:
    b = bytearray(obj)
    b[at] ^= 0x40
    return bytes(b)


def test_damage_of_every_kind_is_refused() -> None:
    src = pools("gqa", "fp8_e4m3", 2)
    randomise(src)
    layout = block_layout(src)
    tokens, h = [5, 6, 7, 8], random.randbytes(16)
    obj = encode_block("ns", h, tokens, layout, read_pages(src, [0])[0])
    decode_block(obj, "ns", h, tokens, layout)  # intact: accepted

    def reason(data: bytes, ns: str = "ns", bh: bytes = h, toks: list[int] = tokens, lay=layout) -> str:
        with pytest.raises(BlockRejected) as info:
            decode_block(data, ns, bh, toks, lay)
        return info.value.reason

    assert reason(damaged(obj, len(obj) // 2)) == "checksum"  # a payload byte
    assert reason(damaged(obj, len(obj) - 1)) == "checksum"  # the checksum itself
    assert reason(obj, toks=[5, 6, 7, 9]) == "tokens"
    assert reason(obj, ns="other-model") == "header"
    assert reason(obj, bh=random.randbytes(16)) == "header"  # stored under another block's key
    assert reason(obj[:-10]) == "malformed"
    assert reason(b"") == "malformed"
    assert reason(obj, lay=block_layout(pools("gqa", "bf16", 2))) == "malformed"  # another pool's size
    forged = encode_block("ns", h, [1, 1, 1, 1], layout, read_pages(src, [0])[0])  # valid checksum, wrong tokens
    assert reason(forged) == "tokens"


def test_namespaces_separate_whatever_changes_the_bytes(tmp_path) -> None:
    from types import SimpleNamespace

    from backend.engine import EngineConfig
    from backend.errors import InvalidRequest
    from backend.kv_store_keys import block_key, model_fingerprint, store_namespace

    def ns(model_id: str = "m", kv_format: str = "fp32", page: int = 4, **config) -> str:
        cache = PagedKVCache(gqa_cfg(), kv_format, 2, page, torch.float32)
        return store_namespace(SimpleNamespace(config=EngineConfig(kv_format=kv_format, **config), cache=cache),
                               model_id)

    base = ns()
    assert base == ns()  # stable
    variants = [ns("other"), ns(kv_format="fp8_e4m3"), ns(page=8), ns(dtype="bfloat16"), ns(prefill_weights="int4")]
    assert len({base, *variants}) == 1 + len(variants)
    with pytest.raises(InvalidRequest, match="tensor-parallel"):
        ns(tensor_parallel=2)
    h = random.randbytes(16)
    assert block_key(base, h) == f"edgeserve-kv/{base}/{h.hex()}"
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    first = model_fingerprint(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"x" * 11)
    assert model_fingerprint(tmp_path) != first
