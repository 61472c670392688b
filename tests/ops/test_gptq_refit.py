"""GPTQ's scale refit (ops/gptq.refit_group_params) and the integer-zero grid, on random small linears:
the refit lowers the output error on calibration and fresh inputs for every grid, keeps the codes, and
its result is what the stored weight dequantises to."""

from __future__ import annotations

import pytest
import torch

from backend.compressed_tensors import PackQuantizedWriter, asymmetric_int4
from backend.weight_formats import Int4Format
from ops.gptq import gptq_quantize, integer_zero_group_params, prepare_hessian
from tests.ops.test_gptq import _Correlated, _hessian


@pytest.mark.parametrize("grid", ["asymmetric", "symmetric", "integer_zero"])
def test_refit_lowers_the_output_error_and_keeps_the_codes(grid: str) -> None:
    n, k, out, group = 1024, 256, 64, 128
    dist = _Correlated(k)
    x = dist.sample(n)
    w = torch.randn(out, k) + 0.3 * torch.rand(out, 1)  # groups not centred on 0
    prepared = prepare_hessian(_hessian(x), act_order=True)
    fmt = Int4Format(group)
    kw = {"symmetric": grid == "symmetric", "integer_zero": grid == "integer_zero", "clip": True}
    plain = gptq_quantize(w, prepared, fmt, **kw)
    refit = gptq_quantize(w, prepared, fmt, refit=True, **kw)
    assert torch.equal(plain.stored.tensors["qweight"], refit.stored.tensors["qweight"])
    assert torch.equal(fmt.dequantize(refit.stored), refit.dequantized)
    if grid != "asymmetric":  # the zero point stays a whole number of steps (0 on the symmetric grid)
        zp = -refit.stored.tensors["zeros"].float() / refit.stored.tensors["scales"].float()
        assert (zp - zp.round()).abs().max() < 0.02 and (grid == "integer_zero" or not zp.any())
    x2 = dist.sample(n)
    for inputs in (x, x2):
        err = {name: (inputs @ (w - r.dequantized).t()).norm().item() for name, r in (("plain", plain),
                                                                                        ("refit", refit))}
        assert err["refit"] < err["plain"], (grid, err)


def test_integer_zero_grid_is_asymmetric_int4s_for_uncorrelated_inputs() -> None:
    """With H = I GPTQ is RTN: on the integer-zero grid, `asymmetric_int4`'s codes, scales and zeros bit
    for bit, which `PackQuantizedWriter(symmetric=False)` packs."""
    w = torch.randn(24, 128) * 0.05 + 0.01
    got = gptq_quantize(w, prepare_hessian(torch.eye(128, dtype=torch.float64)), Int4Format(32), integer_zero=True)
    want = asymmetric_int4(w, 32)
    assert all(torch.equal(got.stored.tensors[s], want.tensors[s]) for s in ("qweight", "scales", "zeros"))
    s, z = integer_zero_group_params(w[:, :32])
    assert torch.equal(s, want.tensors["scales"][:, 0].float()) and torch.equal(z, want.tensors["zeros"][:, 0].float())
    packed = PackQuantizedWriter(32, symmetric=False).pack(got.stored)
    assert "weight_zero_point" in packed.tensors
