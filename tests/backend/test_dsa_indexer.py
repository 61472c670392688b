"""The DSA lightning indexer against transformers' indexer modules on random weights.

GlmMoeDsaIndexer (interleaved RoPE, GLM-5) and DeepseekV32Indexer (split-half RoPE, our
`indexer_rope_interleave: false` path) select each query's top-k keys over a whole
sequence; ours runs the same sequence as paged steps (chunked prefill with a cached
prefix, a decode row, a second sequence in the same mixed step) and must select the
same key sets. With an fp32 key cache any difference may only involve keys whose
reference scores tie (to float32 rounding) with the k-th best; with the FP8 key cache
it may only involve near-ties, and the agreement is measured.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from backend.attention import PrefillChunk, StepMetadata
from backend.config import ModelConfig
from backend.indexer_cache import IndexerKeyCache
from backend.layers.dsa_indexer import IndexerStep, load_indexer
from backend.layers.loader import WeightLoader
from backend.rope import RotaryEmbedding

transformers = pytest.importorskip("transformers")

TOPK, PAGE = 6, 4
DIMS = dict(hidden_size=64, q_lora_rank=32, qk_rope_head_dim=8, index_head_dim=32, index_n_heads=8,
            index_topk=TOPK, num_hidden_layers=1, num_attention_heads=2, kv_lora_rank=16, qk_nope_head_dim=8,
            v_head_dim=8, max_position_embeddings=128, vocab_size=64, intermediate_size=64)


def hf_indexer(interleave: bool, seed: int) -> tuple[torch.nn.Module, torch.nn.Module, dict]:
    """A random transformers indexer (GLM-5's when interleave, DeepSeek-V3.2's otherwise), its
    rotary embedding and our config dict for it."""
    torch.manual_seed(seed)
    if interleave:
        from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as m
        hf_cfg = transformers.GlmMoeDsaConfig(**DIMS)
        mod, rope = m.GlmMoeDsaIndexer(hf_cfg, 0), m.GlmMoeDsaRotaryEmbedding(hf_cfg)
    else:
        from transformers.models.deepseek_v32 import modeling_deepseek_v32 as m
        hf_cfg = transformers.DeepseekV32Config(**DIMS)
        mod, rope = m.DeepseekV32Indexer(hf_cfg, 0), m.DeepseekV32RotaryEmbedding(hf_cfg)
    with torch.no_grad():
        for p in mod.parameters():
            p.normal_(0.0, 0.3)
        mod.k_norm.weight.add_(1.0)
    raw = {**DIMS, "architectures": ["GlmMoeDsaForCausalLM"], "indexer_rope_interleave": interleave,
           "indexer_types": ["full"]}
    return mod.eval(), rope, raw


def load_ours(tmp_path: Path, mod: torch.nn.Module, raw: dict) -> tuple[ModelConfig, object]:
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(json.dumps(raw))
    save_file({f"model.layers.0.self_attn.indexer.{k}": v.contiguous() for k, v in mod.state_dict().items()},
              str(tmp_path / "model.safetensors"))
    cfg = ModelConfig.from_dict(raw)
    return cfg, load_indexer(WeightLoader(tmp_path, cfg, torch.float32), 0)


def hf_scores(mod: torch.nn.Module, rope: torch.nn.Module, x: torch.Tensor, qr: torch.Tensor,
              interleave: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' top-k indices [S, k] for one whole sequence, and the index scores [S, S]
    (-inf above the diagonal) recomputed from the module's own pieces (checked to give those indices)."""
    s = x.shape[0]
    pos = torch.arange(s).unsqueeze(0)
    cos, sin = rope(x.unsqueeze(0), pos)
    causal = torch.full((s, s), float("-inf")).triu(1).unsqueeze(0)
    idx = mod(x.unsqueeze(0), qr.unsqueeze(0), (cos, sin), causal, pos)[0]
    m = __import__(type(mod).__module__, fromlist=["x"])
    rotate = m.apply_rotary_pos_emb_interleave if interleave else m.apply_rotary_pos_emb
    with torch.no_grad():
        q = mod.wq_b(qr).view(s, mod.n_heads, mod.head_dim).unsqueeze(0)
        k = mod.k_norm(mod.wk(x)).view(1, s, 1, mod.head_dim)
        r = mod.qk_rope_head_dim
        q_rot, k_rot = rotate(q[..., :r], k[..., :r], cos, sin, unsqueeze_dim=2)
        q, k = torch.cat([q_rot, q[..., r:]], -1)[0], torch.cat([k_rot, k[..., r:]], -1)[0, :, 0]
        sc = torch.einsum("shd,td->sht", q, k).mul(mod.softmax_scale).relu()
        w = mod.weights_proj(x) * mod.n_heads ** -0.5
        scores = torch.einsum("sh,sht->st", w, sc) + causal[0]
    assert torch.equal(scores.topk(min(TOPK, s), dim=-1).indices.sort(-1).values, idx.long().sort(-1).values)
    return idx.long(), scores


def as_mask(idx: torch.Tensor, s: int) -> torch.Tensor:
    mask = torch.zeros(idx.shape[0], s, dtype=torch.bool).scatter_(1, idx, True)
    return mask & (torch.arange(s).unsqueeze(0) <= torch.arange(idx.shape[0]).unsqueeze(1))


def run_steps(cfg: ModelConfig, weights: object, seqs: list[tuple[torch.Tensor, torch.Tensor]],
              key_format: str) -> list[torch.Tensor]:
    """Run two sequences through three paged steps and return each one's selection [S, S]:
    step 1 A[0:7]; step 2 A[7:S-1] + B[0:5] (prefix cached, mixed chunks); step 3 decode A's
    last token + B[5:]."""
    cache = IndexerKeyCache(cfg, num_pages=24, page_size=PAGE, key_format=key_format)
    rope = RotaryEmbedding(cfg)
    perm = torch.randperm(24, generator=torch.Generator().manual_seed(0))
    tables = [perm[:12], perm[12:]]  # 12 pages of 4 tokens each, scattered over the pool
    sa, sb = seqs[0][0].shape[0], seqs[1][0].shape[0]
    out = [torch.zeros(sa, sa, dtype=torch.bool), torch.zeros(sb, sb, dtype=torch.bool)]

    def slots(b: int, lo: int, hi: int) -> torch.Tensor:
        pos = torch.arange(lo, hi)
        return tables[b][pos // PAGE] * PAGE + pos % PAGE

    def step(decode: list[int], chunks: list[tuple[int, int, int]]) -> None:
        """decode: sequences whose last token decodes; chunks: (sequence, lo, hi) prompt rows."""
        rows = [(b, seqs[b][0].shape[0] - 1, seqs[b][0].shape[0]) for b in decode] + chunks
        xs = [seqs[b][0][lo:hi] for b, lo, hi in rows]
        qs = [seqs[b][1][lo:hi] for b, lo, hi in rows]
        positions = [torch.arange(lo, hi) for _, lo, hi in rows]
        slot_list = [slots(b, lo, hi) for b, lo, hi in rows]
        prefills, start = [], len(decode)
        for b, lo, hi in chunks:
            prefills.append(PrefillChunk(start, hi - lo, hi, tables[b].unsqueeze(0)))
            start += hi - lo
        d = len(decode)
        meta = StepMetadata(positions=torch.cat(positions), slots=torch.cat(slot_list), num_decode=d,
                            decode_page_table=torch.stack([tables[b] for b in decode]) if d else None,
                            decode_context_lens=torch.tensor([sa] * d, dtype=torch.int32) if d else None,
                            prefills=prefills, logits_rows=torch.arange(0), page_size=PAGE,
                            mask_dtype=torch.float32)
        sel = IndexerStep(cfg, meta, cache, rope.tables(meta.positions)).selector(0, weights)(
            torch.cat(xs), torch.cat(qs))
        if d:
            assert sel.decode.shape == (d, tables[0].numel() * PAGE)
            assert not sel.decode[:, sa:].any()
            out[0][sa - 1] = sel.decode[0, :sa]
        for (b, lo, hi), mask in zip(chunks, sel.chunks):
            assert mask.shape == (hi - lo, hi)
            out[b][lo:hi, :hi] = mask

    step([], [(0, 0, 7)])
    step([], [(0, 7, sa - 1), (1, 0, 5)])
    step([0], [(1, 5, sb)])
    return out


def check_against(ours: torch.Tensor, ref_idx: torch.Tensor, scores: torch.Tensor, rel_tol: float) -> float:
    """Assert every row selects min(k, causal keys) keys, and that keys where ours and the
    reference differ score within rel_tol (of the row's largest |score|) of the row's k-th best.
    Returns the recall of the reference's keys."""
    s = ours.shape[0]
    ref = as_mask(ref_idx, s)
    assert torch.equal(ours.sum(1), torch.arange(1, s + 1).clamp(max=TOPK))
    assert not (ours & ~torch.ones(s, s, dtype=torch.bool).tril()).any()  # causal
    finite = scores.masked_fill(scores.isinf(), 0.0)
    kth = scores.topk(TOPK, dim=-1).values[:, -1:]  # rows with fewer keys select them all
    diff = ours ^ ref
    near = (scores - kth).abs() <= rel_tol * finite.abs().amax(-1, keepdim=True) + 1e-6
    assert (near | ~diff).all(), f"keys differ away from the top-k boundary in rows {diff.any(1).nonzero()[:, 0]}"
    return float((ours & ref).sum() / ref.sum())


@pytest.mark.parametrize("interleave", [True, False])
def test_selection_matches_transformers_fp32_keys(tmp_path: Path, interleave: bool) -> None:
    mod, rope, raw = hf_indexer(interleave, seed=3)
    cfg, weights = load_ours(tmp_path, mod, raw)
    seqs = [(torch.randn(21, 64), torch.randn(21, 32)), (torch.randn(17, 64), torch.randn(17, 32))]
    ours = run_steps(cfg, weights, seqs, "fp32")
    for (x, qr), sel in zip(seqs, ours):
        idx, scores = hf_scores(mod, rope, x, qr, interleave)
        check_against(sel, idx, scores, rel_tol=1e-5)


def test_selection_fp8_keys_near_ties_only(tmp_path: Path) -> None:
    """FP8 keys (the serving cache) against transformers' float keys: differences only at near-ties.
    Agreement over several random draws (printed with -s)."""
    recalls = []
    for seed in range(3):
        mod, rope, raw = hf_indexer(True, seed=seed)
        (tmp_path / str(seed)).mkdir()
        cfg, weights = load_ours(tmp_path / str(seed), mod, raw)
        seqs = [(torch.randn(40, 64), torch.randn(40, 32)), (torch.randn(33, 64), torch.randn(33, 32))]
        for (x, qr), sel in zip(seqs, run_steps(cfg, weights, seqs, "fp8_e4m3")):
            idx, scores = hf_scores(mod, rope, x, qr, True)
            recalls.append(check_against(sel, idx, scores, rel_tol=0.08))
    recall = sum(recalls) / len(recalls)
    print(f"fp8 indexer keys: recall of transformers' selected keys {recall:.4f}")
    assert recall > 0.95


def test_scores_in_row_blocks_select_the_same(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Scoring one query row at a time (the memory bound for long contexts) changes nothing."""
    import backend.layers.dsa_indexer as dsa

    mod, _, raw = hf_indexer(True, seed=5)
    cfg, weights = load_ours(tmp_path, mod, raw)
    seqs = [(torch.randn(30, 64), torch.randn(30, 32)), (torch.randn(19, 64), torch.randn(19, 32))]
    whole = run_steps(cfg, weights, seqs, "fp8_e4m3")
    monkeypatch.setattr(dsa, "SCORE_BLOCK", 1)
    for a, b in zip(whole, run_steps(cfg, weights, seqs, "fp8_e4m3")):
        assert torch.equal(a, b)


def test_missing_or_misshaped_indexer_tensors_are_typed_errors(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from backend.errors import WeightsError

    mod, _, raw = hf_indexer(True, seed=0)
    load_ours(tmp_path, mod, raw)
    f = tmp_path / "model.safetensors"
    tensors = load_file(f)
    cfg = ModelConfig.from_dict(raw)
    tensors["model.layers.0.self_attn.indexer.wk.weight"] = torch.randn(16, 64)
    save_file(tensors, str(f))
    with pytest.raises(WeightsError, match="indexer.wk"):
        load_indexer(WeightLoader(tmp_path, cfg, torch.float32), 0)
    del tensors["model.layers.0.self_attn.indexer.wk.weight"]
    save_file(tensors, str(f))
    with pytest.raises(WeightsError, match="indexer.wk"):
        load_indexer(WeightLoader(tmp_path, cfg, torch.float32), 0)
    shared = ModelConfig.from_dict({**raw, "num_hidden_layers": 2, "indexer_types": ["full", "shared"]})
    assert load_indexer(WeightLoader(tmp_path, shared, torch.float32), 1) is None
