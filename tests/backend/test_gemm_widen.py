"""Bfloat16 GEMMs widened to float32: same result as the bfloat16 GEMM up to summation order,
taken only for calls of many rows, and only where the measurement (or the override) says so."""

from __future__ import annotations

import pytest
import torch

from backend import gemm_widen, linear
from backend.gemm_widen import WIDEN_MIN_ROWS, widened_linear, widening_pays
from backend.linear import Linear


@pytest.fixture
def forced(monkeypatch: pytest.MonkeyPatch):
    """Set EDGESERVE_BF16_WIDEN for one test, with the per-process answer forgotten before and after."""
    def force(value: str) -> None:
        monkeypatch.setenv("EDGESERVE_BF16_WIDEN", value)
        widening_pays.cache_clear()

    yield force
    widening_pays.cache_clear()


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().t()
    return (y if b is None else y + b.double()).to(x.dtype)


@pytest.mark.parametrize("bias", [False, True])
def test_widened_linear_matches_the_exact_product_rounded_once(bias: bool) -> None:
    x = torch.randn(WIDEN_MIN_ROWS + 3, 200).to(torch.bfloat16)
    w = torch.randn(96, 200).to(torch.bfloat16)
    b = torch.randn(96).to(torch.bfloat16) if bias else None
    y = widened_linear(x, w.t(), b)
    assert y.dtype == torch.bfloat16 and y.shape == (WIDEN_MIN_ROWS + 3, 96)
    # float32 sums of exact products, rounded to bfloat16 once: within one bfloat16 ulp of the exact value
    torch.testing.assert_close(y.float(), _reference(x, w, b).float(), rtol=2 ** -7, atol=1e-3)
    # and as close to it as torch's own bfloat16 GEMM (which also sums in float32)
    err_widened = (y.double() - (x.double() @ w.double().t() + (0 if b is None else b.double()))).abs().mean()
    ours = torch.nn.functional.linear(x, w, b)
    err_torch = (ours.double() - (x.double() @ w.double().t() + (0 if b is None else b.double()))).abs().mean()
    assert err_widened <= 1.5 * err_torch


@pytest.mark.parametrize("rows, widened", [(WIDEN_MIN_ROWS - 1, False), (WIDEN_MIN_ROWS, True), (300, True)])
def test_linear_widens_only_calls_of_many_rows(forced, monkeypatch: pytest.MonkeyPatch, rows: int,
                                               widened: bool) -> None:
    forced("1")
    calls: list[int] = []

    def spy(x, weight_t, bias):
        calls.append(x.shape[0])
        return widened_linear(x, weight_t, bias)

    monkeypatch.setattr(linear, "widened_linear", spy)
    w, b = torch.randn(64, 48).to(torch.bfloat16), torch.randn(64).to(torch.bfloat16)
    x = torch.randn(rows, 48).to(torch.bfloat16)
    y = Linear(w, b)(x)
    assert calls == ([rows] if widened else [])
    torch.testing.assert_close(y.float(), _reference(x, w, b).float(), rtol=2 ** -7, atol=1e-2)


def test_linear_does_not_widen_when_it_does_not_pay(forced, monkeypatch: pytest.MonkeyPatch) -> None:
    forced("0")
    monkeypatch.setattr(linear, "widened_linear", lambda *a: pytest.fail("widened although forced off"))
    w = torch.randn(32, 16).to(torch.bfloat16)
    assert Linear(w)(torch.randn(WIDEN_MIN_ROWS * 2, 16).to(torch.bfloat16)).shape == (WIDEN_MIN_ROWS * 2, 32)


def test_float32_weights_never_widen(forced) -> None:
    forced("1")
    assert not Linear(torch.randn(8, 8)).widen
    assert Linear(torch.randn(8, 8).to(torch.bfloat16)).widen


def test_float32_activations_on_bf16_weights_keep_their_dtype(forced) -> None:
    forced("1")
    w = torch.randn(40, 24).to(torch.bfloat16)
    x = torch.randn(WIDEN_MIN_ROWS, 24)
    y = Linear(w)(x)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, x @ w.float().t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("times, pays", [((2.0e-3, 1.0e-3), True), ((1.1e-3, 1.0e-3), False),
                                         ((1.0e-3, 2.0e-3), False)])
def test_auto_widens_when_the_measured_float32_path_is_clearly_faster(forced, monkeypatch: pytest.MonkeyPatch,
                                                                      times: tuple[float, float],
                                                                      pays: bool) -> None:
    forced("auto")
    monkeypatch.setattr(gemm_widen, "measure_widening", lambda: times)
    assert widening_pays() is pays


def test_measure_widening_times_both_paths() -> None:
    bf16_s, widened_s = gemm_widen.measure_widening(reps=2)
    assert 0 < bf16_s < 5 and 0 < widened_s < 5
