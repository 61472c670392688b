"""The row-wise argmax kernel (kernels/cpu/argmax.c) against torch.argmax on fresh random logits, float32 and
bfloat16 (against the float32 copy's argmax): vocabularies
that are not multiples of the 16-lane vector, ties (the first index wins), NaN (the first NaN wins, wherever the
maximum is), infinities and rows of -inf; None for what it does not handle; and the sampler taking it."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu_argmax import argmax_rows, available, build_error, mask_fill_rows
from tests.kernels.test_kv_store import seed  # noqa: F401  (fixture)

pytestmark = pytest.mark.skipif(not available(), reason=f"argmax kernel not built: {build_error()}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 1000, 49152, 49157])
@pytest.mark.parametrize("rows", [1, 3, 32])
def test_matches_torch(rows: int, vocab: int, dtype: torch.dtype, seed: int) -> None:
    x = torch.randn(rows, vocab).to(dtype)  # bf16: many values repeat (8 mantissa bits), so ties are common
    assert torch.equal(argmax_rows(x), x.float().argmax(dim=-1))
    ties = torch.randint(-3, 4, (rows, vocab)).to(dtype)  # many equal maxima per row: the first one
    assert torch.equal(argmax_rows(ties), ties.float().argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_special_values(dtype: torch.dtype, seed: int) -> None:
    x = torch.randn(8, 1000)
    x[0, 900] = float("nan")  # after the maximum: still the NaN
    x[0, 5] = 1e30
    x[1, 3], x[1, 700] = float("nan"), float("nan")  # the first NaN
    x[2, 600] = float("inf")
    x[3] = float("-inf")  # all -inf: index 0
    x[4, 17], x[4, 999] = float("inf"), float("inf")  # the first inf
    x[5, 999] = float("nan")  # in the scalar tail of a 1000-column row
    x[6] = -0.0
    x[6, 400] = 0.0  # -0.0 == 0.0: index 0
    x[7, 42] = -0.0  # a negative zero among negatives is the maximum
    x[7].clamp_(max=-1e-3)
    x[7, 42] = -0.0
    x = x.to(dtype)
    assert torch.equal(argmax_rows(x), x.float().argmax(dim=-1))


def test_declines_what_it_does_not_handle() -> None:
    x = torch.randn(4, 64)
    assert argmax_rows(x.half()) is None
    assert argmax_rows(x.t()) is None  # strided
    assert argmax_rows(x[0]) is None  # 1-D
    assert argmax_rows(torch.empty(4, 0)) is None
    assert argmax_rows(torch.empty(0, 64)).shape == (0,)


def test_the_sampler_takes_it_for_greedy_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    import backend.sampler as sampler
    from backend.sampling_params import SamplingParams

    calls = []
    monkeypatch.setattr(sampler, "argmax_rows", lambda x, w=None: calls.append(x.shape) or argmax_rows(x, w))
    logits = torch.randn(3, 500)
    got = sampler.sample(logits, [SamplingParams(temperature=0.0)] * 3, [None] * 3)
    assert calls == [(3, 500)] and got == logits.argmax(dim=-1).tolist()


def _random_words(rows: int, vocab: int, density: float) -> torch.Tensor:
    """int32 [rows, ceil(vocab / 32)] grammar mask words with about `density` of the tokens allowed; the bits
    past the vocabulary are random too (the kernels must not read them as tokens)."""
    bits = torch.rand(rows, (vocab + 31) // 32, 32) < density
    weights = torch.tensor([1 << i for i in range(32)], dtype=torch.int64)
    return ((bits.long() * weights).sum(-1) - ((bits[..., 31].long()) << 32)).to(torch.int32)


def _torch_masked(x: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """The sampler's torch path: forbidden tokens at -inf (float32)."""
    allowed = ((words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten(1)[:, : x.shape[1]].bool()
    return x.float().masked_fill(~allowed, float("-inf"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 17, 32, 1000, 49152, 49157])
@pytest.mark.parametrize("density", [0.0, 0.002, 0.5, 1.0])
def test_masked_argmax_matches_torch_after_masked_fill(vocab: int, density: float, dtype: torch.dtype,
                                                       seed: int) -> None:
    x = torch.randn(5, vocab)
    x[1, vocab // 2] = float("nan")  # a NaN counts only where its token is allowed
    x[2, vocab - 1] = float("inf")
    x = x.to(dtype)
    words = _random_words(5, vocab, density)
    words[3] = -1  # a row with every token allowed: the plain argmax
    words[4, 0] = 0  # nothing allowed in the first 32 tokens
    want = _torch_masked(x, words).argmax(dim=-1)
    assert torch.equal(argmax_rows(x, words), want)
    assert torch.equal(argmax_rows(x, words)[3], x.float().argmax(dim=-1)[3])


@pytest.mark.parametrize("vocab", [1, 17, 32, 1000, 49157])
@pytest.mark.parametrize("density", [0.0, 0.01, 0.5, 1.0])
def test_mask_fill_rows_matches_torch(vocab: int, density: float, seed: int) -> None:
    x = torch.randn(4, vocab)
    words = _random_words(4, vocab, density)
    want = _torch_masked(x, words)
    got = x.clone()
    assert mask_fill_rows(got, words)
    assert torch.equal(got, want)


def test_masked_kernels_decline_what_they_do_not_handle() -> None:
    x = torch.randn(4, 64)
    words = _random_words(4, 64, 0.5)
    assert argmax_rows(x, words[:, :1].contiguous()) is None  # too few words for the vocabulary
    assert argmax_rows(x, words.long()) is None
    assert argmax_rows(x, words[:3].contiguous()) is None  # not a row of words per row of logits
    before = x.clone()
    assert not mask_fill_rows(x.bfloat16(), words) and not mask_fill_rows(x.t(), words)
    assert not mask_fill_rows(x, words[:, :1].contiguous()) and torch.equal(x, before)


def test_the_sampler_takes_the_masked_argmax_for_greedy_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    import backend.sampler as sampler
    from backend.sampling_params import SamplingParams

    calls = []
    monkeypatch.setattr(sampler, "argmax_rows", lambda x, w=None: calls.append(w is not None) or argmax_rows(x, w))
    logits = torch.randn(3, 500).bfloat16()
    words = _random_words(3, 500, 0.05)
    masks = [words[0], None, words[2]]
    want = _torch_masked(logits, torch.stack([words[0], torch.full_like(words[0], -1), words[2]])).argmax(dim=-1)
    got = sampler.sample(logits, [SamplingParams(temperature=0.0)] * 3, [None] * 3, masks=masks)
    assert calls == [True] and got == want.tolist()  # one call, on the bfloat16 logits, no masked copy
