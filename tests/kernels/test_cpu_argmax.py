"""The row-wise argmax kernel (kernels/cpu/argmax.c) against torch.argmax on fresh random logits, float32 and
bfloat16 (against the float32 copy's argmax): vocabularies
that are not multiples of the 16-lane vector, ties (the first index wins), NaN (the first NaN wins, wherever the
maximum is), infinities and rows of -inf; None for what it does not handle; and the sampler taking it."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu_argmax import argmax_rows, available, build_error
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
    monkeypatch.setattr(sampler, "argmax_rows", lambda x: calls.append(x.shape) or argmax_rows(x))
    logits = torch.randn(3, 500)
    got = sampler.sample(logits, [SamplingParams(temperature=0.0)] * 3, [None] * 3)
    assert calls == [(3, 500)] and got == logits.argmax(dim=-1).tolist()
