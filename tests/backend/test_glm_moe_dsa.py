"""GlmMoeDsaForCausalLM (GLM-5.x: MLA + MoE + DSA) against transformers' own, on tiny random
checkpoints written by `save_pretrained`, with `index_topk` well below the sequence lengths so
the lightning indexer really prunes keys, and "full" and "shared" indexer layers mixed.

Parity (float32, fp32 latent pages, max abs logit diff <= 1e-4) is checked with an fp32
indexer key cache: transformers scores un-quantised indexer keys, so that is the same
computation. The serving FP8 indexer cache is compared separately (top-k agreement and
logit error where a near-tie flips a selected key).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from backend.engine import EngineConfig, LLMEngine
from backend.indexer_cache import IndexerKeyCache
from tests.backend.parity_checks import assert_chunked_prefill_and_decode_match, assert_greedy_equals_generate
from tests.backend.test_model_parity import _our_logits_all_rows
from tests.backend.tiny_models import make_decisive, reference_model, to_fp8_block_checkpoint

transformers = pytest.importorskip("transformers")

ATOL = 1e-4
TOPK = 8
GLM_DSA_TINY: dict[str, Any] = dict(
    vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=1,
    topk_group=1, first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=1.5,
    index_topk=TOPK, index_head_dim=32, index_n_heads=16, indexer_types=["full", "shared", "full", "shared"],
    attention_bias=False, max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=2)


def write_tiny_glm_moe_dsa(path: Path, seed: int = 0, **overrides: Any) -> Path:
    """Save a random float32 `GlmMoeDsaForCausalLM` (`GLM_DSA_TINY` with `overrides`) to `path`,
    weights scaled up from the 0.02 init so attention, the indexer and the router are decisive."""
    torch.manual_seed(seed)
    cfg = transformers.GlmMoeDsaConfig(**{**GLM_DSA_TINY, **overrides})
    model = transformers.GlmMoeDsaForCausalLM(cfg)
    make_decisive(model, attention_std=0.12)
    model.eval().save_pretrained(path, safe_serialization=True)
    return path


def _engine(path: Path, index_keys: str = "fp32", **kw: Any) -> LLMEngine:
    cfg = dict(dtype="float32", kv_format="fp32", kv_cache_bytes=4 * 2**20, page_size=16, gemm_buckets=())
    engine = LLMEngine.from_pretrained(path, EngineConfig(**{**cfg, **kw}))
    if index_keys != "fp8_e4m3":
        c = engine.cache
        c.indexer = IndexerKeyCache(engine.model.cfg, c.num_pages, c.page_size, key_format=index_keys)
    return engine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_glm_moe_dsa(tmp_path_factory.mktemp("glm5") / "m", seed=1)


def test_prefill_logits_match_transformers_and_need_the_indexer(model_dir: Path) -> None:
    """One-shot prefill of 60 tokens (top-8 keys per query); the same model without its key
    selection (dense MLA) is far off, so the parity really exercises the indexer."""
    ref = reference_model(model_dir)
    ids = torch.randint(0, 320, (60,)).tolist()
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    engine = _engine(model_dir)
    got = _our_logits_all_rows(engine, ids)
    assert expected.abs().max().item() > 0.3
    assert (got - expected).abs().max().item() <= ATOL
    for layer in engine.model.phase_layers["prefill"]:
        layer.mla.selector = None
    assert (_our_logits_all_rows(engine, ids) - expected).abs().max().item() > 0.05


def test_chunked_prefill_and_paged_decode_match_transformers(model_dir: Path) -> None:
    """Mixed lengths in one batch, chunks of 7 over pages of 16 (a cached prefix under each
    later chunk), decode rows sharing steps with prompt chunks: every sampled position's logits
    equal the reference's and the greedy tokens are its argmax."""
    ref = reference_model(model_dir)
    ours = _engine(model_dir, prefill_chunk_size=7, max_num_batched_tokens=16)
    assert_chunked_prefill_and_decode_match(ours, ref, ATOL)


def test_greedy_32_tokens_equal_transformers_generate(model_dir: Path) -> None:
    assert_greedy_equals_generate(_engine(model_dir), reference_model(model_dir))


def _logits_and_selections(engine: LLMEngine, ids: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One-shot prefill logits, and each layer's prompt selection [n, n] as MLA received it."""
    seen: list[torch.Tensor] = []
    for layer in engine.model.phase_layers["prefill"]:
        def record(*args: Any, _select: Any = layer.mla.selector) -> Any:
            selection = _select(*args)
            seen.append(selection.chunks[0])
            return selection
        layer.mla.selector = record
    return _our_logits_all_rows(engine, ids), seen


def test_fp8_index_keys_agree_with_float_keys(model_dir: Path) -> None:
    """The serving FP8 indexer keys against float32 keys on the same model (fp32 latent pages):
    top-k recall of layer 0 (same inputs, only the key rounding differs) and of all layers, and
    the mean KL divergence of next-token distributions (printed with -s)."""
    ids = torch.randint(0, 320, (120,)).tolist()
    ref, ref_sel = _logits_and_selections(_engine(model_dir), ids)
    got, got_sel = _logits_and_selections(_engine(model_dir, index_keys="fp8_e4m3"), ids)
    assert len(ref_sel) == len(got_sel) == GLM_DSA_TINY["num_hidden_layers"]
    assert ref_sel[1] is ref_sel[0] and ref_sel[3] is ref_sel[2]  # "shared" layers reuse the full layer's
    recalls = [float((a & b).sum() / a.sum()) for a, b in zip(ref_sel, got_sel)]
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                    reduction="none").sum(-1).mean().item()
    print(f"fp8 index keys vs fp32: top-{TOPK} recall layer 0 {recalls[0]:.4f}, "
          f"all layers {sum(recalls) / len(recalls):.4f}; mean KL {kl:.2e}")
    assert recalls[0] > 0.9 and min(recalls) > 0.7
    assert 0 < kl < 0.02


def test_disaggregated_pair_equals_unified(model_dir: Path) -> None:
    """A prefill worker ships the prompt's latent rows and its FP8 indexer keys to a decode worker
    over loopback HTTP; every decode step's selection reads the shipped keys (37 prompt tokens,
    top-8), and the greedy tokens equal a unified engine's; both pools end empty."""
    from tests.backend.test_disagg import GREEDY, generate, pair, tokens, unified, wait_free

    prompt = torch.randint(3, 320, (37,)).tolist()
    with pair(model_dir, decode_kv="bf16", wire="bf16") as (url, dec, prefills):
        got = tokens(generate(url, prompt, max_tokens=10, **GREEDY))
        assert got == unified(model_dir, "bf16", prompt, max_tokens=10, **GREEDY)
        wait_free(dec, *prefills)


def test_fp8_block_scaled_checkpoint_matches_transformers_on_the_dequantised_weights(tmp_path: Path) -> None:
    """GLM-5-FP8's layout: every projection (MLA, indexer wq_b and wk, experts, dense MLP) as e4m3
    with 16x16 block scales, the indexer's weights_proj and the router kept dense. Reference:
    transformers on a dense copy holding exactly the dequantised values."""
    from backend.weights import CheckpointReader

    path = write_tiny_glm_moe_dsa(tmp_path / "m", seed=6)
    ref_dir = tmp_path / "dense"
    to_fp8_block_checkpoint(path, ref_dir, lambda name: name.startswith("model.layers.") and name.endswith(
        ("_proj.weight", "indexer.wq_b.weight", "indexer.wk.weight")) and not name.endswith("weights_proj.weight"))
    assert "model.layers.0.self_attn.indexer.wq_b.weight_scale_inv" in CheckpointReader(path)
    ids = torch.randint(0, 320, (40,)).tolist()
    with torch.no_grad():
        expected = reference_model(ref_dir)(torch.tensor([ids])).logits[0]
    got = _our_logits_all_rows(_engine(path), ids)
    assert (got - expected).abs().max().item() <= ATOL


def test_quantize_converts_the_indexer_linears_and_the_result_loads(model_dir: Path, tmp_path: Path) -> None:
    """`edgeserve quantize` knows GLM-5's tensors: the MLA linears and, on "full" layers only, the
    indexer's wq_b/wk come out FP8, its k_norm and weights_proj as stored; the engine then computes
    what a dense checkpoint of the dequantised weights gives."""
    from backend.config import load_config
    from backend.weight_formats import weight_format
    from backend.weights import CheckpointReader
    from ops import quantize
    from tests.ops.test_quantize import _dequantized_copy

    out = tmp_path / "q"
    quantize.quantize_checkpoint(model_dir, out, weight_format("fp8"), progress=False)
    reader = CheckpointReader(out)
    types = load_config(model_dir).indexer_types
    assert "shared" in types and "full" in types
    for i, kind in enumerate(types):
        x = f"model.layers.{i}.self_attn.indexer."
        assert (f"{x}wq_b.weight_scale_inv" in reader) == (kind == "full")
        if kind == "full":
            assert reader.spec(f"{x}wk.weight").dtype == torch.float8_e4m3fn
            assert reader.spec(f"{x}weights_proj.weight").dtype == torch.float32
    ids = torch.randint(0, 320, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    got = _our_logits_all_rows(_engine(out), ids)
    operand = _our_logits_all_rows(_engine(_dequantized_copy(out, tmp_path / "deq")), ids)
    assert (got - operand).abs().max().item() <= 1e-5
