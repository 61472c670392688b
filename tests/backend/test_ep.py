"""Mixture of experts and MLA under tensor and expert parallelism (gloo, CPU): a tiny Glm4Moe at
TP 2 (experts split by intermediate rows) and at TP 2 + EP 2 (whole experts per rank, shared
experts tensor-parallel), a tiny DeepseekV3 (MLA: latent replicated, heads split) at TP 2 + EP 2:
greedy output identical to one process, logits within 1e-4 in float32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backend.distributed.sharding import ShardPlan
from backend.config import load_config
from backend.layers.experts import ExpertShard
from backend.moe_experts import RoutedExperts
from backend.weight_formats import DenseFormat
from tests.backend.test_tp import assert_same, expected_bytes, generate, prompts_for
from tests.backend.tiny_mla_models import write_tiny_deepseek_v3
from tests.backend.tiny_models import write_tiny_glm4_moe


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # q/k norm and q/k/v biases on, a dense first layer, grouped routing
    return write_tiny_glm4_moe(tmp_path_factory.mktemp("glm") / "m", seed=2, use_qk_norm=True, attention_bias=True,
                               n_group=2, topk_group=1)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "tp2-ep2"])
def test_glm4_moe_parallel_equals_one_process(glm_dir: Path, expert_parallel: bool) -> None:
    prompts = prompts_for(320, seed=4)
    ref = generate(glm_dir, 1, prompts)
    got = generate(glm_dir, 2, prompts, expert_parallel=expert_parallel)
    assert_same(ref, got)
    assert got.bytes_read == expected_bytes(glm_dir, 2, expert_parallel=expert_parallel)


def test_deepseek_v3_tp2_ep2(tmp_path: Path) -> None:
    path = write_tiny_deepseek_v3(tmp_path / "m", seed=3)
    prompts = prompts_for(320, seed=5)
    ref = generate(path, 1, prompts)
    got = generate(path, 2, prompts, expert_parallel=True)
    assert_same(ref, got)
    assert got.bytes_read == expected_bytes(path, 2, expert_parallel=True)


def test_expert_shard_sums_to_all_experts() -> None:
    """Each rank's ExpertShard runs only its experts' slots; the shards' outputs sum to the whole layer's."""
    torch.manual_seed(0)
    e, h, i, t, k, world = 8, 16, 8, 11, 3, 4
    fmt = DenseFormat(torch.float32)
    gate_up = [fmt.quantize(torch.randn(2 * i, h)) for _ in range(e)]
    down = [fmt.quantize(torch.randn(h, i)) for _ in range(e)]
    x = torch.randn(t, h)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)])  # [T, k] distinct experts per token
    weights = torch.rand(t, k)
    whole = RoutedExperts(fmt, gate_up, down, torch.float32)(x, ids, weights)
    parts = []
    for r in range(world):
        lo, hi = r * e // world, (r + 1) * e // world
        shard = ExpertShard(RoutedExperts(fmt, gate_up[lo:hi], down[lo:hi], torch.float32), lo, e)
        parts.append(shard(x, ids, weights))
        hit = ((ids >= lo) & (ids < hi)).any(1)
        assert not parts[-1][~hit].any()  # tokens routed only elsewhere get zero rows here
    torch.testing.assert_close(sum(parts), whole, atol=1e-5, rtol=1e-5)


def test_ep_plan_reads_whole_experts_of_its_own(glm_dir: Path) -> None:
    cfg = load_config(glm_dir)
    plans = [ShardPlan(cfg, r, 2, expert_parallel=True) for r in range(2)]
    assert [list(p.experts) for p in plans] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    name = "model.layers.1.mlp.experts.5.gate_proj.weight"
    assert plans[1].slice_of(name, (32, 64)) is None  # whole
    shared = "model.layers.1.mlp.shared_experts.down_proj.weight"
    assert plans[1].slice_of(shared, (64, 32)) == (1, 16, 32)  # shared experts stay tensor-parallel
