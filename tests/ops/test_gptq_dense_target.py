"""The dense target (`ops.gptq.dense_target_map`, `LayerCalibrator(dense_target=True)`): a linear whose
inputs drifted from the dense model's is fitted to the dense model's outputs, not to its own weight."""

from __future__ import annotations

import torch

from backend.weight_formats import Int4Format
from ops.gptq import dense_target_map, gptq_quantize, prepare_hessian
from tests.ops.test_gptq import _Correlated, _hessian


class _Drifted:
    """Pairs (x, x_dense) [n, k]: the dense model's inputs and the quantised model's, which differ by a
    fixed linear distortion plus noise, as the inputs of a layer behind quantised layers do."""

    def __init__(self, k: int) -> None:
        self.dense = _Correlated(k)
        self.distort = torch.eye(k) + 0.08 * torch.randn(k, k) / k ** 0.5

    def sample(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        x_dense = self.dense.sample(n)
        return x_dense @ self.distort + 0.05 * torch.randn(n, x_dense.shape[1]), x_dense


def test_map_is_identity_without_drift_and_least_squares_with_it() -> None:
    x = _Correlated(48).sample(400)
    torch.testing.assert_close(dense_target_map(x, x), torch.eye(48), rtol=0, atol=1e-5)
    x, x_dense = _Drifted(48).sample(400)
    w = torch.randn(16, 48)
    v = w @ dense_target_map(x, x_dense, damp=1e-9).t()
    lstsq = torch.linalg.lstsq(x.double(), (x_dense @ w.t()).double()).solution.t().float()  # [16, 48]
    torch.testing.assert_close(v, lstsq, rtol=1e-3, atol=1e-3)
    target = x_dense @ w.t()
    assert (x @ v.t() - target).norm() < 0.5 * (x @ w.t() - target).norm()


def test_gptq_of_the_mapped_weight_is_closer_to_the_dense_outputs_on_fresh_inputs() -> None:
    """GPTQ on W Tᵀ against the drifted inputs' Hessian beats GPTQ on W at matching the dense model's
    outputs x_dense Wᵀ, on the calibration rows and on fresh rows of the same drift."""
    k, fmt = 256, Int4Format(64)
    drift = _Drifted(k)
    x, x_dense = drift.sample(2000)
    w = torch.randn(64, k)
    prepared = prepare_hessian(_hessian(x), act_order=True)
    plain = gptq_quantize(w, prepared, fmt, clip=True).dequantized
    mapped = gptq_quantize(w @ dense_target_map(x, x_dense).t(), prepared, fmt, clip=True).dequantized
    for xs, xd in ((x, x_dense), drift.sample(2000)):
        target = xd @ w.t()
        err_plain, err_mapped = (xs @ plain.t() - target).norm(), (xs @ mapped.t() - target).norm()
        assert err_mapped < 0.8 * err_plain, (float(err_mapped), float(err_plain))
