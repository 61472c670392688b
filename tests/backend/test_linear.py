"""MKL-packed bucketed linear equals F.linear for every row count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from backend.linear import Linear, _plan, mkl_packing_available


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 9, 31, 32, 33, 40, 100, 128, 129, 300])
def test_bucketed_linear_matches_f_linear(rows: int) -> None:
    w, b = torch.randn(70, 48), torch.randn(70)
    x = torch.randn(rows, 48)
    lin = Linear(w, b, buckets=(8, 32, 128))
    assert bool(lin.packs) == mkl_packing_available()
    torch.testing.assert_close(lin(x), F.linear(x, w, b), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", range(1, 400, 7))
def test_plan_covers_every_row_exactly_once(rows: int) -> None:
    plan = _plan(rows, (8, 32, 128))
    covered = [r for start, length, _ in plan for r in range(start, start + length)]
    assert covered == list(range(rows))
    assert all(bucket == 0 or length <= bucket for _, length, bucket in plan)


def test_bf16_weights_are_never_packed() -> None:
    lin = Linear(torch.randn(16, 16, dtype=torch.bfloat16), None, buckets=(8,))
    assert not lin.packs
