"""Engine behaviour: seeded sampling, stop strings, failures that must not take the worker down."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from backend.async_engine import AsyncEngine
from backend.engine import EngineConfig, LLMEngine
from backend.protocol import ErrorEvent, FinishEvent, TokenEvent
from backend.sampling_params import SamplingParams
from tests.backend.tiny_models import write_tiny_model

CFG = dict(dtype="float32", kv_format="fp32", kv_cache_bytes=2**20)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "m", "llama", seed=5)


def run_all(engine: LLMEngine) -> None:
    while engine.has_work():
        engine.step()


def test_same_seed_same_output_different_seed_different_output(tiny_dir: Path) -> None:
    engine = LLMEngine.from_pretrained(tiny_dir, EngineConfig(**CFG))
    hot = dict(max_tokens=24, temperature=1.5, ignore_eos=True)
    a = engine.add_request([4, 5, 6], SamplingParams(seed=42, **hot))
    b = engine.add_request([4, 5, 6], SamplingParams(seed=42, **hot))  # same batch, same seed
    c = engine.add_request([4, 5, 6], SamplingParams(seed=7, **hot))
    run_all(engine)
    d = engine.add_request([4, 5, 6], SamplingParams(seed=42, **hot))  # later, alone
    run_all(engine)
    assert a.output_ids == b.output_ids == d.output_ids
    assert c.output_ids != a.output_ids


def test_a_failing_step_errors_its_requests_frees_pages_and_the_worker_goes_on(tiny_dir: Path) -> None:
    engine = LLMEngine.from_pretrained(tiny_dir, EngineConfig(**CFG))
    aengine = AsyncEngine(engine)
    real_run = engine.runner.run
    calls = {"n": 0}

    def flaky(batch):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected failure")
        return real_run(batch)

    engine.runner.run = flaky  # type: ignore[method-assign]

    async def one(max_tokens: int) -> list:
        return [ev async for ev in aengine.generate([3, 4, 5], SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                              ignore_eos=True))]

    async def scenario():
        first = await one(10)
        second = await one(10)
        return first, second

    try:
        first, second = asyncio.run(scenario())
    finally:
        aengine.shutdown()
    assert isinstance(first[-1], ErrorEvent) and "injected failure" in first[-1].message
    assert first[-1].completion_tokens == sum(len(e.token_ids) for e in first if isinstance(e, TokenEvent))
    assert isinstance(second[-1], FinishEvent) and second[-1].completion_tokens == 10
    assert engine.allocator.num_free == engine.allocator.num_pages


@pytest.mark.model
def test_stop_string_ends_generation_right_after_it_appears(smollm2_dir: Path) -> None:
    from backend.tokenizer import Tokenizer

    tok = Tokenizer.from_model_dir(smollm2_dir)
    engine = LLMEngine.from_pretrained(smollm2_dir, EngineConfig(**{**CFG, "kv_cache_bytes": 16 * 2**20}))
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Count from one to twenty in words."}]))
    free = engine.add_request(ids, SamplingParams(max_tokens=40, temperature=0.0))
    run_all(engine)
    text = tok.decode(free.output_ids)
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert len(stop) == 3 and stop.strip()
    stopped = engine.add_request(ids, SamplingParams(max_tokens=40, temperature=0.0, stop=[stop]))
    run_all(engine)
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.output_ids == free.output_ids[: len(stopped.output_ids)]
    assert stop in tok.decode(stopped.output_ids)
    assert stop not in tok.decode(stopped.output_ids[:-1])
    assert engine.allocator.num_free == engine.allocator.num_pages


def test_score_equals_the_reference_log_likelihood(tiny_dir: Path) -> None:
    import torch

    from tests.backend.tiny_models import reference_model

    engine = LLMEngine.from_pretrained(tiny_dir, EngineConfig(**CFG, prefill_chunk_size=13))
    ids = torch.randint(0, 320, (70,)).tolist()
    got = engine.score(ids)
    with torch.no_grad():
        logits = reference_model(tiny_dir)(torch.tensor([ids])).logits[0, :-1]
    expected = logits.log_softmax(-1).gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
    assert got.shape == (69,)
    assert (got - expected).abs().max().item() < 1e-4
    assert engine.allocator.num_free == engine.allocator.num_pages
