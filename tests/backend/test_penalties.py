"""Frequency, presence and repetition penalties in the batched sampler, against a plain reference."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from backend.engine import EngineConfig, LLMEngine
from backend.errors import InvalidSamplingParams
from backend.penalties import apply_penalties, apply_penalties_ref
from backend.sampler import sample
from backend.sampling_params import SamplingParams
from tests.backend.tiny_models import write_tiny_model

VOCAB = 300


def _history(rng: random.Random) -> tuple[list[int], list[int]]:
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 40))]
    output = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 40))]
    output += output[: len(output) // 2]  # repeats, so counts above 1 occur
    return prompt, output


@pytest.mark.parametrize("fields", [
    dict(frequency_penalty=0.7), dict(presence_penalty=-1.3), dict(frequency_penalty=-0.4, presence_penalty=1.9),
    dict(repetition_penalty=1.3), dict(repetition_penalty=0.6),
    dict(frequency_penalty=2.0, presence_penalty=0.5, repetition_penalty=1.8)])
def test_penalties_match_the_plain_reference(fields: dict) -> None:
    rng = random.Random()
    logits = torch.randn(5, VOCAB) * 3  # positive and negative logits
    histories = [_history(rng) for _ in range(5)]
    params = [SamplingParams(**fields), SamplingParams(), SamplingParams(**fields), SamplingParams(repetition_penalty=1.1),
              SamplingParams(**fields)]
    got = apply_penalties(logits, params, [h[0] for h in histories], [h[1] for h in histories])
    for i, (p, (prompt, output)) in enumerate(zip(params, histories)):
        want = torch.tensor(apply_penalties_ref(logits[i].tolist(), p, prompt, output))
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[1], logits[1])  # a row without penalties is untouched


def test_no_penalty_anywhere_is_the_same_tensor() -> None:
    logits = torch.randn(3, VOCAB)
    assert apply_penalties(logits, [SamplingParams()] * 3, [[1]] * 3, [[2]] * 3) is logits


def test_greedy_with_penalties_moves_off_a_repeated_token() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, 7] = 1.0
    logits[:, 8] = 0.9
    plain, penal = SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, presence_penalty=0.5)
    assert sample(logits, [plain, penal], [None, None], [[1], [1]], [[7], [7]]) == [7, 8]
    rep = SamplingParams(temperature=0.0, repetition_penalty=1.2)  # 7 seen in the prompt: 1/1.2 < 0.9
    assert sample(logits[:1], [rep], [None], [[7]], [[]]) == [8]


def test_a_row_samples_the_same_whatever_the_other_rows_penalties() -> None:
    logits = torch.randn(1, VOCAB)
    mine = SamplingParams(temperature=1.0, seed=3, frequency_penalty=0.8)
    alone = sample(logits, [mine], [torch.Generator().manual_seed(3)], [[1, 2]], [[5, 5, 6]])
    others = [SamplingParams(temperature=0.7, seed=9, presence_penalty=-2.0), SamplingParams(repetition_penalty=0.3)]
    batch = torch.cat([torch.randn(1, VOCAB), logits, torch.randn(1, VOCAB)])
    out = sample(batch, [others[0], mine, others[1]],
                 [torch.Generator().manual_seed(9), torch.Generator().manual_seed(3), None],
                 [[4], [1, 2], [8]], [[4, 4], [5, 5, 6], []])
    assert out[1] == alone[0]


@pytest.mark.parametrize("bad", [dict(frequency_penalty=2.5), dict(presence_penalty=-2.1),
                                 dict(repetition_penalty=0.0), dict(repetition_penalty=2.5),
                                 dict(frequency_penalty=float("nan")), dict(logprobs=21), dict(prompt_logprobs=-1),
                                 dict(max_tokens=0)])
def test_bad_values_name_the_field(bad: dict) -> None:
    with pytest.raises(InvalidSamplingParams) as info:
        SamplingParams(**bad).validate(100)
    assert info.value.details["field"] == next(iter(bad))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "m", "llama", seed=5)


def _run(engine: LLMEngine) -> None:
    while engine.has_work():
        engine.step()


def test_engine_penalised_seeded_requests_alone_equal_in_a_batch(tiny_dir: Path) -> None:
    engine = LLMEngine.from_pretrained(tiny_dir, EngineConfig(dtype="float32", kv_format="fp32",
                                                              kv_cache_bytes=2**20))
    hot = dict(max_tokens=20, temperature=1.2, ignore_eos=True, seed=11)
    pen = SamplingParams(frequency_penalty=1.5, presence_penalty=0.5, **hot)
    alone = engine.add_request([4, 5, 6], pen)
    _run(engine)
    batch = [engine.add_request([4, 5, 6], pen), engine.add_request([4, 5, 6], SamplingParams(**hot)),
             engine.add_request([9, 9], SamplingParams(repetition_penalty=1.9, **hot))]
    _run(engine)
    assert batch[0].output_ids == alone.output_ids
    assert batch[1].output_ids != alone.output_ids  # the penalty changed what the same seed picks
    greedy = engine.add_request([4, 5, 6], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    greedy_pen = engine.add_request([4, 5, 6], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                                              presence_penalty=2.0))
    _run(engine)
    assert len(set(greedy_pen.output_ids)) > len(set(greedy.output_ids))  # fewer repeats
