"""GlmMoeDsa (GLM-5.x: MLA + MoE + DeepSeek sparse attention) under tensor parallelism on gloo (CPU).

The lightning indexer is replicated on every rank (its weights whole, its FP8 key cache beside the
replicated latent pages), so every rank selects the same keys one process would: a tiny GlmMoeDsa
with index_topk 8 below the prompt lengths (17 and 30 tokens, then decode) and "full" and "shared"
indexer layers mixed gives one process's greedy output at TP 2 and TP 2 + EP 2, logits within 1e-4
in float32, each rank reading the indexer whole and the rest of the model in its slices. A decode
group of 2 installs prefill KV frames (latent rows with the indexer's key rows) on both ranks and
decodes like one process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backend.config import load_config
from backend.distributed.collectives import Collectives
from backend.distributed.group import GroupSpec, start_group
from backend.distributed.sharding import ShardPlan
from backend.engine import LLMEngine
from backend.model import load_model
from tests.backend.test_glm_moe_dsa import write_tiny_glm_moe_dsa
from tests.backend.test_tp import assert_same, expected_bytes, generate, prompts_for
from tests.backend.test_tp_kv_transfer import _config, decode_from, held_kv, wire


@pytest.fixture(scope="module")
def dsa_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_glm_moe_dsa(tmp_path_factory.mktemp("glm5") / "m", seed=3)


def test_plan_replicates_the_indexer(dsa_dir: Path) -> None:
    cfg = load_config(dsa_dir)
    assert cfg.index_topk == 8 and "shared" in cfg.indexer_types
    plan = ShardPlan(cfg, 1, 2)
    for name, shape in (("wq_b.weight", (512, 48)), ("wk.weight", (32, 64)), ("weights_proj.weight", (16, 64)),
                        ("k_norm.weight", (32,))):
        assert plan.slice_of(f"model.layers.0.self_attn.indexer.{name}", shape) is None  # whole on every rank
    local = plan.local_config()
    assert (local.index_topk, local.index_n_heads, local.index_head_dim) == (8, 16, 32)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "tp2-ep2"])
def test_glm_moe_dsa_parallel_equals_one_process(dsa_dir: Path, expert_parallel: bool) -> None:
    prompts = prompts_for(320, seed=8)
    assert max(len(p) for p in prompts) > 8  # the indexer really prunes keys
    ref = generate(dsa_dir, 1, prompts)
    got = generate(dsa_dir, 2, prompts, expert_parallel=expert_parallel)
    assert_same(ref, got)
    assert got.bytes_read == expected_bytes(dsa_dir, 2, expert_parallel=expert_parallel)
    follower = load_model(dsa_dir, group=Collectives(1, 2), expert_parallel=expert_parallel)  # rank 1's shard
    assert follower.bytes_read == expected_bytes(dsa_dir, 2, rank=1, expert_parallel=expert_parallel)


def test_decode_group_installs_latent_and_indexer_rows(dsa_dir: Path) -> None:
    """Prefill KV (37 tokens: latent rows and indexer key rows) through the wire into a decode group of
    2: both ranks hold rank 0's rows, so the group decodes one process's tokens."""
    one = LLMEngine.from_pretrained(dsa_dir, _config("fp32", 1))
    first, layers = held_kv(one)
    assert all(rows.index_rows is not None for rows, _ in layers)
    frames = wire(layers, "bf16", one.model.cfg)
    ref_tokens, ref_logits = decode_from(one, first, frames)
    group = start_group(GroupSpec(2, str(dsa_dir), _config("fp32", 2), timeout_s=60))
    try:
        two = LLMEngine.from_pretrained(dsa_dir, _config("fp32", 2), group.coll)
        first2, layers2 = held_kv(two)  # a prefill group reads rank 0's rows, indexer keys included
        assert first2 == first
        for (rows, _), (ref_rows, _) in zip(layers2, layers):
            torch.testing.assert_close(rows.rows, ref_rows.rows, atol=1e-5, rtol=1e-5)
            assert rows.index_rows.shape == ref_rows.index_rows.shape
        tokens, logits = decode_from(two, first, frames)
    finally:
        group.shutdown()
    assert tokens == ref_tokens
    assert (logits - ref_logits).abs().max().item() <= 1e-4
