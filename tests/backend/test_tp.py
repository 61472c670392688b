"""Tensor parallelism on gloo (CPU): a group of ranks (the test process is rank 0, the others are
spawned) produces the same greedy output as one process, logits within 1e-4 in float32, and each
rank reads only its slice of every tensor."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from backend.config import load_config
from backend.distributed.group import GroupSpec, start_group
from backend.distributed.sharding import LEADER_ONLY, ShardPlan, TensorSlice
from backend.engine import EngineConfig, LLMEngine
from backend.errors import ModelLoadError
from backend.sampling_params import SamplingParams
from backend.weights import CheckpointReader
from tests.backend.engine_spy import record_sampled_logits
from tests.backend.tiny_models import write_tiny_model

ATOL = 1e-4


class Run(NamedTuple):
    outputs: list[list[int]]
    logits: list[torch.Tensor]  # per request: [generated, vocab] sampled-from rows
    bytes_read: int  # rank 0's checkpoint bytes
    collectives: dict[str, Any] | None


def generate(path: Path, world: int, prompts: list[list[int]], max_tokens: int = 6, expert_parallel: bool = False,
             **engine: Any) -> Run:
    """Greedy generation through chunked prefill (chunks of 7) and paged decode, on `world` ranks."""
    config = EngineConfig(**{**dict(dtype="float32", kv_format="fp32", kv_cache_bytes=2 * 2**20, page_size=16,
                                    gemm_buckets=(), num_threads=1, prefill_chunk_size=7, max_num_batched_tokens=16,
                                    tensor_parallel=world, expert_parallel=expert_parallel), **engine})
    group = start_group(GroupSpec(world, str(path), config, expert_parallel, timeout_s=60)) if world > 1 else None
    try:
        eng = LLMEngine.from_pretrained(path, config, group.coll if group is not None else None)
        seqs = [eng.add_request(p, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
                for p in prompts]
        seen = record_sampled_logits(eng)
        while eng.has_work():
            eng.step()
        assert eng.allocator.num_free == eng.allocator.num_pages
        return Run([s.output_ids for s in seqs], [torch.stack(seen[s.request_id]) for s in seqs],
                   eng.model.bytes_read, group.coll.snapshot() if group is not None else None)
    finally:
        if group is not None:
            group.shutdown()


def assert_same(ref: Run, got: Run) -> None:
    assert got.outputs == ref.outputs
    diff = max((a - b).abs().max().item() for a, b in zip(ref.logits, got.logits))
    assert diff <= ATOL, diff


def expected_bytes(path: Path, world: int, rank: int = 0, expert_parallel: bool = False) -> int:
    """Bytes rank `rank` should read: the plan's slice of every tensor it reads, nothing else."""
    cfg = load_config(path)
    plan = ShardPlan(cfg, rank, world, expert_parallel)
    ckpt = CheckpointReader(path)
    total = 0
    for name in ckpt.names():
        expert = re.search(r"mlp\.experts\.(\d+)\.", name)
        if expert is not None and int(expert.group(1)) not in plan.experts:
            continue  # another expert-parallel rank's expert: never read
        spec = ckpt.spec(name)
        how = plan.slice_of(name, spec.shape)
        n = spec.nbytes
        if isinstance(how, TensorSlice):
            n = n // spec.shape[how.dim] * (how.stop - how.start)
        elif how == LEADER_ONLY and rank:
            n = 0
        total += n
    return total


def prompts_for(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (1, 17, 30)]


CASES = {
    # fewer KV heads than ranks: the one KV head replicated on both ranks; uneven vocabulary shards
    "llama-tp2-kv1": ("llama", 2, dict(num_attention_heads=8, num_key_value_heads=1, vocab_size=321)),
    # 2 KV heads over 4 ranks (each on two), tied embeddings: the LM head is the embedding's shard
    "llama-tp4-kv2-tied": ("llama", 4, dict(num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True)),
    # q/k/v biases follow their rows; KV heads split (one per rank)
    "qwen2-tp2-kv2": ("qwen2", 2, dict()),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tp_greedy_equals_one_process(tmp_path: Path, case: str) -> None:
    arch, world, overrides = CASES[case]
    path = write_tiny_model(tmp_path / "m", arch, seed=7, **overrides)
    prompts = prompts_for(overrides.get("vocab_size", 320))
    ref = generate(path, 1, prompts)
    got = generate(path, world, prompts)
    assert_same(ref, got)
    assert got.bytes_read == expected_bytes(path, world)
    assert got.bytes_read < ref.bytes_read * (0.6 if world == 2 else 0.35)
    layers = load_config(path).num_layers
    steps = got.collectives["calls"]["gather"]  # one logits gather per forward pass
    assert got.collectives["calls"]["all_reduce"] == steps * (2 * layers + 1)


def test_smollm2_tp3(smollm2_dir: Path) -> None:
    """SmolLM2-135M (9 query / 3 KV heads, tied embeddings) at TP 3: one KV head per rank."""
    prompts = prompts_for(49152, seed=3)
    ref = generate(smollm2_dir, 1, prompts, max_tokens=4, kv_cache_bytes=8 * 2**20)
    got = generate(smollm2_dir, 3, prompts, max_tokens=4, kv_cache_bytes=8 * 2**20)
    assert_same(ref, got)
    assert got.bytes_read == expected_bytes(smollm2_dir, 3)


def test_plan_refuses_what_does_not_split(tmp_path: Path) -> None:
    cfg = load_config(write_tiny_model(tmp_path / "m", "llama", num_attention_heads=6, num_key_value_heads=2))
    with pytest.raises(ModelLoadError, match="attention heads"):
        ShardPlan(cfg, 0, 4)
    cfg = load_config(write_tiny_model(tmp_path / "n", "llama", num_attention_heads=12, num_key_value_heads=6))
    with pytest.raises(ModelLoadError, match="KV heads"):
        ShardPlan(cfg, 0, 4)
    with pytest.raises(ModelLoadError, match="intermediate_size"):
        ShardPlan(load_config(write_tiny_model(tmp_path / "o", "llama", intermediate_size=129)), 0, 2)


def test_kv_heads_each_rank_holds() -> None:
    """Each rank's query heads read exactly the KV heads it holds (GQA group unchanged)."""
    from dataclasses import replace

    from backend.config import ModelConfig

    base = ModelConfig(architecture="LlamaForCausalLM", vocab_size=10, hidden_size=64, intermediate_size=72,
                       num_layers=1, num_heads=8, num_kv_heads=2, head_dim=8, max_position_embeddings=16,
                       rms_norm_eps=1e-5, rope_theta=1e4, rope_scaling=None, tie_word_embeddings=False,
                       attention_bias=False)
    for heads, kv, world in [(8, 2, 2), (8, 2, 4), (8, 1, 8), (8, 8, 4), (9, 3, 3)]:
        cfg = replace(base, num_heads=heads, num_kv_heads=kv)
        for rank in range(world):
            plan = ShardPlan(cfg, rank, world)
            needed = {h // (heads // kv) for h in plan.heads}
            assert needed == set(plan.kv_heads)
            local = plan.local_config()
            assert (local.num_heads, local.num_kv_heads) == (heads // world, max(kv // world, 1))
