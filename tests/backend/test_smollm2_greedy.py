"""Greedy generation on the real SmolLM2 weights matches `transformers`, token for token (float32).

Where the two diverge it must be a genuine near-tie: the reference's token is
within our top 2 and our logit gap to it is under 1e-3. The test reports every
such case and fails on anything else.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backend.engine import EngineConfig, LLMEngine
from backend.sampling_params import SamplingParams
from tests.backend.engine_spy import record_sampled_logits

pytestmark = pytest.mark.model

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the ocean.",
    "Explain photosynthesis to a child.",
    "List three uses for a paperclip.",
    "Translate 'good morning' into Spanish and German.",
    "What is 17 times 23?",
]
NEW_TOKENS = 32


def test_greedy_matches_transformers(smollm2_dir: Path) -> None:
    import transformers

    from backend.tokenizer import Tokenizer

    tok = Tokenizer.from_model_dir(smollm2_dir)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True))
               for p in PROMPTS]
    engine = LLMEngine.from_pretrained(smollm2_dir, EngineConfig(dtype="float32", kv_format="fp32",
                                                                 kv_cache_bytes=64 * 2**20))
    seqs = [engine.add_request(ids, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)) for ids in prompts]
    seen = record_sampled_logits(engine)
    while engine.has_work():  # all prompts batched together, continuous batching
        engine.step()

    ref = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    near_ties = []
    for s, ids in zip(seqs, prompts):
        with torch.inference_mode():
            expected = ref.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                    pad_token_id=0)[0, len(ids):].tolist()
        ours = s.output_ids
        n = min(len(ours), len(expected))
        assert n >= 1
        mismatch = next((i for i in range(n) if ours[i] != expected[i]), None)
        if mismatch is None:
            assert ours[:n] == expected[:n]
            continue
        logits = seen[s.request_id][mismatch]
        top2 = logits.topk(2).indices.tolist()
        gap = (logits[ours[mismatch]] - logits[expected[mismatch]]).item()
        assert expected[mismatch] in top2 and gap < 1e-3, (
            f"prompt {PROMPTS[seqs.index(s)]!r} diverged at token {mismatch}: ours {ours[mismatch]} vs reference "
            f"{expected[mismatch]} (top2 {top2}, gap {gap:.2e}) — not a near-tie")
        near_ties.append((PROMPTS[seqs.index(s)], mismatch, gap))
    if near_ties:
        print(f"near-ties (accepted): {near_ties}")
    assert len(near_ties) <= 1, f"too many divergences for float32: {near_ties}"
    assert engine.allocator.num_free == engine.allocator.num_pages
