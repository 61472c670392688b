"""Batched sampling with per-request parameters."""

from __future__ import annotations

import pytest
import torch

from backend.errors import InvalidSamplingParams
from backend.sampler import sample
from backend.sampling_params import SamplingParams


def test_greedy_rows_take_the_argmax_whatever_the_other_rows_do() -> None:
    logits = torch.randn(6, 500)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 3
    out = sample(logits, params, [None] * 6)
    assert [out[i] for i in (0, 2, 4)] == logits.argmax(-1)[[0, 2, 4]].tolist()


def test_same_seed_same_tokens_different_seed_different_tokens() -> None:
    logits = torch.randn(1, 1000)
    hot = SamplingParams(temperature=5.0, seed=1234)

    def draw(seed: int) -> list[int]:
        gen = torch.Generator().manual_seed(seed)
        return [sample(logits, [hot], [gen])[0] for _ in range(20)]

    assert draw(1234) == draw(1234)
    assert draw(1234) != draw(4321)


def test_top_k_limits_the_support() -> None:
    logits = torch.randn(1, 300).repeat(400, 1)
    params = [SamplingParams(temperature=3.0, top_k=5)] * 400
    out = set(sample(logits, params, [None] * 400))
    allowed = set(logits[0].topk(5).indices.tolist())
    assert out <= allowed and len(out) == 5


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().unsqueeze(0).repeat(2000, 1)
    out = sample(logits, [SamplingParams(temperature=1.0, top_p=0.7)] * 2000, [None] * 2000)
    counts = torch.bincount(torch.tensor(out), minlength=4).float() / 2000
    assert counts[2] == 0 and counts[3] == 0  # 0.5 + 0.3 >= 0.7: tokens 2 and 3 are cut
    assert abs(counts[0].item() - 0.5 / 0.8) < 0.05


def test_a_top_k_past_the_vocabulary_is_no_cut() -> None:
    logits = torch.randn(2, 50)
    params = [SamplingParams(temperature=1.0, top_k=10**12), SamplingParams(temperature=1.0, top_k=50)]
    out = sample(logits.repeat(200, 1), params * 200, [None] * 400)
    assert len(set(out[0::2])) > 10 and all(0 <= t < 50 for t in out)


def test_top_p_keeps_ties_with_the_last_kept_token() -> None:
    logits = torch.tensor([0.4, 0.2, 0.2, 0.2, 0.05]).log().unsqueeze(0).repeat(3000, 1)
    logits[1] = float("-inf")  # a row with nothing left (a grammar that allows no token) is left as it is
    out = sample(logits, [SamplingParams(temperature=1.0, top_p=0.5)] * 3000, [None] * 3000)
    counts = torch.bincount(torch.tensor(out[2:]), minlength=5)
    assert counts[4] == 0 and all(counts[i] > 0 for i in range(4))  # 0.4 + one 0.2 reach 0.5: all three 0.2s stay
    from backend.sampler import _apply_top_p
    assert torch.isinf(_apply_top_p(logits[1:2], [0.5])).all()


def test_temperature_sampling_follows_the_softmax() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(20000, 1)
    out = sample(logits, [SamplingParams(temperature=2.0)] * 20000, [None] * 20000)
    freq = torch.bincount(torch.tensor(out), minlength=4).float() / 20000
    expected = (logits[0] / 2.0).softmax(-1)
    assert (freq - expected).abs().max().item() < 0.02


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(temperature=-1.0), dict(top_p=1.5), dict(top_k=-2),
                                 dict(stop=[""]), dict(stop_token_ids=[10**9]), dict(seed=-1)])
def test_bad_parameters_name_the_field(bad: dict) -> None:
    with pytest.raises(InvalidSamplingParams) as err:
        SamplingParams(**bad).validate(vocab_size=1000)
    assert err.value.details["field"] == next(iter(bad))


@pytest.mark.parametrize("kind", ["greedy", "seeded", "penalised", "masked"])
def test_bfloat16_logits_give_the_tokens_of_their_float32_copy(kind: str) -> None:
    """The engine hands over the LM head's bfloat16 logits: plain greedy rows take their argmax as they
    are, any other batch is widened first, so every kind of row gets the float32 copy's token."""
    logits = (torch.randn(4, 300) * 3).to(torch.bfloat16)
    greedy = dict(temperature=0.0)
    params = {"greedy": [SamplingParams(**greedy)] * 4,
              "seeded": [SamplingParams(temperature=0.8, seed=s) for s in range(4)],
              "penalised": [SamplingParams(**greedy, frequency_penalty=1.5)] * 4,
              "masked": [SamplingParams(**greedy)] * 4}[kind]
    outputs = [[int(logits[i].float().argmax())] * 3 for i in range(4)]  # penalise each row's own argmax
    masks = [None] * 4
    if kind == "masked":
        masks = [torch.full((10,), -1, dtype=torch.int32)] * 3 + [torch.zeros(10, dtype=torch.int32)]
        masks[3][0] = 1 << 5  # only token 5 allowed in the last row

    def run(x: torch.Tensor) -> list[int]:
        gens = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]
        return sample(x, params, gens, [[]] * 4, outputs, masks)

    got, want = run(logits), run(logits.float())
    assert got == want
    if kind == "penalised":  # the penalty moved every row off its own argmax
        assert all(g != o[0] for g, o in zip(got, outputs))
    if kind == "masked":
        assert got[3] == 5


def test_a_penalty_on_bfloat16_logits_is_applied_in_float32() -> None:
    """8.0 - 0.07 is 7.93 in float32, below 7.9375; in bfloat16 it rounds to 7.9375 and ties (index 0 wins)."""
    logits = torch.full((1, 8), -10.0)
    logits[0, 0], logits[0, 1] = 8.0, 7.9375  # one bfloat16 step apart
    params = [SamplingParams(temperature=0.0, frequency_penalty=0.07)]
    assert sample(logits.to(torch.bfloat16), params, [None], [[]], [[0]]) == [1]
