"""Engine-vs-`transformers` checks shared by the per-architecture parity tests (test helper)."""

from __future__ import annotations

import torch

from backend.engine import LLMEngine
from backend.sampling_params import SamplingParams
from tests.backend.engine_spy import record_sampled_logits

__all__ = ["assert_chunked_prefill_and_decode_match", "assert_greedy_equals_generate"]


def assert_chunked_prefill_and_decode_match(ours: LLMEngine, ref: torch.nn.Module, atol: float) -> None:
    """Prompts of 1, 15, 17 and 33 tokens in one engine (configure it with small chunks so decode
    rows share steps with prompt chunks), 8 greedy tokens each: every sampled position's logits
    are within `atol` of the reference's, the tokens are its argmax, and every page is free after."""
    prompts = [torch.randint(0, 320, (n,)).tolist() for n in (1, 15, 17, 33)]
    seqs = [ours.add_request(p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)) for p in prompts]
    seen = record_sampled_logits(ours)
    while ours.has_work():
        ours.step()
    assert ours.model.steps_by_phase["mixed"] > 0  # decode rows really shared steps with prompt chunks
    for s in seqs:
        full = s.prompt_ids + s.output_ids
        with torch.no_grad():
            expected = ref(torch.tensor([full])).logits[0, s.num_prompt_tokens - 1: -1]
        got = torch.stack(seen[s.request_id])
        assert (got - expected).abs().max().item() <= atol
        assert s.output_ids == expected.argmax(-1).tolist()
    assert ours.allocator.num_free == ours.allocator.num_pages


def assert_greedy_equals_generate(engine: LLMEngine, ref: torch.nn.Module, num_tokens: int = 32) -> None:
    """`num_tokens` greedy tokens of an 11-token random prompt equal `ref.generate`'s (and vary)."""
    prompt = torch.randint(3, 320, (11,)).tolist()
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=num_tokens, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(prompt):].tolist()
    seq = engine.add_request(prompt, SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True))
    while engine.has_work():
        engine.step()
    assert seq.output_ids == want and len(set(want)) > 3
