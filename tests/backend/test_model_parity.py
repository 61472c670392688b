"""Our Llama-family runtime against `transformers` on tiny random configs (float32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backend.engine import EngineConfig, LLMEngine
from backend.sampling_params import SamplingParams
from tests.backend.engine_spy import record_sampled_logits
from tests.backend.tiny_models import reference_model, write_tiny_model

ATOL = 1e-4


def _our_logits_all_rows(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """Logits for every position of ids, computed as one prefill."""
    seq = engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0.0))
    batch = engine.scheduler.schedule()
    assert batch.prefill and batch.prefill[0][0] is seq and batch.prefill[0][1] == len(ids)
    input_ids, meta = engine.runner.prepare(batch)
    meta.logits_rows = torch.arange(len(ids))
    logits = engine.model.forward(input_ids, meta, engine.cache)
    engine.scheduler.finish(seq, "stop")
    return logits


def _engine(path: Path, **kw) -> LLMEngine:
    cfg = EngineConfig(dtype="float32", kv_format="fp32", kv_cache_bytes=8 * 2**20, page_size=16, **kw)
    return LLMEngine.from_pretrained(path, cfg)


ROPE_CASES = [
    ("llama", {}),
    ("qwen2", {}),
    ("llama", {"tie_word_embeddings": True}),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}}),
    ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
    ("qwen2", {"num_key_value_heads": 6, "rope_theta": 1e6}),
]


@pytest.mark.parametrize("arch,overrides", ROPE_CASES, ids=[f"{a}-{i}" for i, (a, _) in enumerate(ROPE_CASES)])
def test_prefill_logits_match_transformers(tmp_path: Path, arch: str, overrides: dict) -> None:
    path = write_tiny_model(tmp_path / "m", arch, **overrides)
    ref = reference_model(path)
    ours = _engine(path)
    ids = torch.randint(0, 320, (150,)).tolist()
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    got = _our_logits_all_rows(ours, ids)
    assert (got - expected).abs().max().item() <= ATOL


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_chunked_prefill_and_paged_decode_match_transformers(tmp_path: Path, arch: str) -> None:
    """Greedy continuation through chunked prefill (chunks of 7, pages of 16) and decode
    steps equals the reference's logits at every generated position."""
    path = write_tiny_model(tmp_path / "m", arch, seed=3)
    ref = reference_model(path)
    ours = _engine(path, prefill_chunk_size=7, max_num_batched_tokens=16)
    prompts = [torch.randint(0, 320, (n,)).tolist() for n in (1, 15, 16, 17, 40)]
    seqs = [ours.add_request(p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)) for p in prompts]
    logits_seen = record_sampled_logits(ours)
    while ours.has_work():
        ours.step()
    for s in seqs:
        full = s.prompt_ids + s.output_ids
        with torch.no_grad():
            expected = ref(torch.tensor([full])).logits[0, s.num_prompt_tokens - 1: -1]
        got = torch.stack(logits_seen[s.request_id])
        assert got.shape == expected.shape
        assert (got - expected).abs().max().item() <= ATOL
        assert s.output_ids == expected.argmax(-1).tolist()
    assert ours.allocator.num_free == ours.allocator.num_pages
