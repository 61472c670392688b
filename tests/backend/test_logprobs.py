"""Logprobs of generated tokens and of prompts (echo), on the serving path."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch

from backend.async_engine import AsyncEngine
from backend.engine import EngineConfig, LLMEngine
from backend.protocol import FinishEvent, TokenEvent
from backend.sampling_params import SamplingParams
from tests.backend.tiny_models import write_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "m", "llama", seed=5)


def _engine(tiny_dir: Path, **kw) -> LLMEngine:
    return LLMEngine.from_pretrained(tiny_dir, EngineConfig(dtype="float32", kv_format="fp32", kv_cache_bytes=2**21,
                                                            **kw))


def _run(engine: LLMEngine) -> list:
    outs = []
    while engine.has_work():
        outs += engine.step()
    return outs


@pytest.mark.parametrize("chunk", [7, 256])
def test_prompt_logprobs_equal_offline_scoring_chunked_and_batched(tiny_dir: Path, chunk: int) -> None:
    engine = _engine(tiny_dir, prefill_chunk_size=chunk, max_num_batched_tokens=64, prefix_caching=True)
    rng = random.Random()
    prompt = [rng.randrange(3, 200) for _ in range(40)]
    want = engine.score_tokens(prompt)
    engine.add_request(prompt, SamplingParams(max_tokens=3, ignore_eos=True))  # fills the prefix cache
    _run(engine)
    others = [engine.add_request([rng.randrange(3, 200) for _ in range(n)], SamplingParams(max_tokens=4))
              for n in (5, 30)]
    scored = engine.add_request(prompt, SamplingParams(max_tokens=0, prompt_logprobs=5))
    gen = engine.add_request(prompt, SamplingParams(max_tokens=2, prompt_logprobs=0, ignore_eos=True))
    outs = _run(engine)
    by_seq = {id(o.seq): o for o in outs if o.prompt_logprobs is not None}
    for seq in (scored, gen):
        lp = by_seq[id(seq)].prompt_logprobs
        torch.testing.assert_close(torch.tensor(lp.token), want.logprobs, rtol=1e-4, atol=1e-4)
    top = by_seq[id(scored)].prompt_logprobs
    assert all(len(ids) == 5 for ids in top.top_ids) and len(top.top_ids) == len(prompt) - 1
    assert [ids[0] == prompt[i + 1] for i, ids in enumerate(top.top_ids)] == want.top1.tolist()
    assert scored.output_ids == [] and scored.finish_reason == "length"
    assert len(gen.output_ids) == 2 and all(len(o.output_ids) == 4 or o.finish_reason for o in others)


def test_generated_logprobs_are_the_models_and_ranked(tiny_dir: Path) -> None:
    engine = _engine(tiny_dir)
    seq = engine.add_request([4, 5, 6], SamplingParams(max_tokens=6, temperature=0.0, logprobs=4, ignore_eos=True))
    plain = engine.add_request([4, 5, 6], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    outs = [o for o in _run(engine) if o.seq is seq and o.new_token is not None]
    assert all(o.logprobs is None for o in _run(engine))
    assert seq.output_ids == plain.output_ids
    full = engine.score_tokens([4, 5, 6, *seq.output_ids]).logprobs[2:]
    for o, want in zip(outs, full.tolist()):
        assert o.logprobs.top_ids[0][0] == o.new_token  # greedy: the top alternative
        assert o.logprobs.token[0] == pytest.approx(want, abs=1e-4)
        assert o.logprobs.top_logprobs[0] == sorted(o.logprobs.top_logprobs[0], reverse=True)


def test_async_engine_events_carry_them_only_when_asked(tiny_dir: Path) -> None:
    async def go() -> tuple[list, list]:
        eng = AsyncEngine(_engine(tiny_dir))
        try:
            asked = [ev async for ev in eng.generate([4, 5, 6, 7], SamplingParams(max_tokens=0, prompt_logprobs=1))]
            plain = [ev async for ev in eng.generate([4, 5, 6, 7], SamplingParams(max_tokens=2))]
            return asked, plain
        finally:
            eng.shutdown()

    asked, plain = asyncio.run(go())
    assert isinstance(asked[0], TokenEvent) and asked[0].token_ids == [] and len(asked[0].prompt_logprobs.token) == 3
    assert isinstance(asked[-1], FinishEvent) and asked[-1].completion_tokens == 0
    assert all(ev.logprobs is None and ev.prompt_logprobs is None for ev in plain if isinstance(ev, TokenEvent))
