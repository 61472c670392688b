"""GPTQ (ops/gptq.py) on random small linears: lower output error than RTN on correlated inputs,
RTN exactly when the inputs are uncorrelated, stored in the INT4 format bit for bit."""

from __future__ import annotations

import pytest
import torch

from backend.errors import WeightsError
from backend.weight_formats import Int4Format
from ops.gptq import HessianAccumulator, gptq_quantize, prepare_hessian


class _Correlated:
    """A distribution of inputs [n, k] with strongly correlated columns and uneven scales, like a
    layer's activations; `sample` draws fresh rows of the same distribution."""

    def __init__(self, k: int) -> None:
        self.mix = torch.randn(k, k) / k ** 0.5 + torch.eye(k)
        self.basis = torch.randn(8, k)
        self.scale = torch.rand(k).add(0.2)

    def sample(self, n: int) -> torch.Tensor:
        return (torch.randn(n, self.mix.shape[0]) @ self.mix + 2 * torch.randn(n, 8) @ self.basis) * self.scale


def _correlated_inputs(n: int, k: int) -> torch.Tensor:
    return _Correlated(k).sample(n)


def _hessian(x: torch.Tensor) -> torch.Tensor:
    acc = HessianAccumulator(x.shape[1])
    for part in x.split(97):  # accumulated in pieces = all at once
        acc.add(part)
    return acc.value()


def test_hessian_is_two_xtx_over_n() -> None:
    x = torch.randn(300, 24)
    h = _hessian(x)
    assert h.dtype == torch.float64
    torch.testing.assert_close(h, 2 * x.double().t() @ x.double() / 300, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("group,act_order", [(32, False), (32, True), (128, False), (64, True)])
def test_gptq_output_error_is_lower_than_rtn(group: int, act_order: bool) -> None:
    n, k, out = 512, 192, 48  # 192 = 128 + 64: a partial last group at g128
    dist = _Correlated(k)
    x = dist.sample(n)
    w = torch.randn(out, k)
    fmt = Int4Format(group)
    got = gptq_quantize(w, prepare_hessian(_hessian(x), act_order), fmt)
    rtn = fmt.dequantize(fmt.quantize(w))
    ref = x @ w.t()
    err_gptq = (ref - x @ got.dequantized.t()).norm()
    err_rtn = (ref - x @ rtn.t()).norm()
    assert err_gptq < 0.8 * err_rtn, (float(err_gptq), float(err_rtn))
    # and on fresh inputs of the same distribution (not just the calibration rows)
    x2 = dist.sample(n)
    assert (x2 @ w.t() - x2 @ got.dequantized.t()).norm() < (x2 @ w.t() - x2 @ rtn.t()).norm()


@pytest.mark.parametrize("group,act_order", [(32, False), (128, False), (128, True)])
def test_identity_hessian_gives_rtn_bit_for_bit(group: int, act_order: bool) -> None:
    """With H = I (uncorrelated unit inputs) U is diagonal and every error update is zero:
    GPTQ's codes, scales and zeros are RTN's. (Act-order over equal diagonals keeps column order.)"""
    w = torch.randn(40, 320) * torch.rand(40, 1)
    fmt = Int4Format(group)
    got = gptq_quantize(w, prepare_hessian(torch.eye(320, dtype=torch.float64), act_order), fmt)
    rtn = fmt.quantize(w)
    for suffix in fmt.suffixes:
        assert torch.equal(got.stored.tensors[suffix], rtn.tensors[suffix]), suffix


@pytest.mark.parametrize("group,act_order", [(32, True), (128, False), (256, False)])
def test_result_round_trips_through_int4_format(group: int, act_order: bool) -> None:
    k = 288
    x = _correlated_inputs(400, k)
    w = torch.randn(36, k, dtype=torch.bfloat16)
    fmt = Int4Format(group)
    got = gptq_quantize(w, prepare_hessian(_hessian(x), act_order), fmt)
    assert {s: (t.dtype, tuple(t.shape)) for s, t in got.stored.tensors.items()} == \
        {s: (spec.dtype, spec.shape) for s, spec in fmt.specs((36, k)).items()}
    assert torch.equal(fmt.dequantize(got.stored), got.dequantized)


def test_dead_input_columns_and_act_order_permutation() -> None:
    """A column whose input is always zero cannot matter: its weights become 0 and nothing breaks;
    act-order visits columns by decreasing energy yet stores codes in column order."""
    x = _correlated_inputs(300, 64)
    x[:, 5] = 0
    w = torch.randn(16, 64)
    prepared = prepare_hessian(_hessian(x), act_order=True)
    assert bool(prepared.dead[5]) and prepared.perm is not None and sorted(prepared.perm.tolist()) == list(range(64))
    got = gptq_quantize(w, prepared, Int4Format(32))
    assert torch.isfinite(got.dequantized).all()
    ref = x @ w.t()
    rtn = Int4Format(32).dequantize(Int4Format(32).quantize(w))
    assert (ref - x @ got.dequantized.t()).norm() < (ref - x @ rtn.t()).norm()


def test_bad_shapes_are_typed_errors() -> None:
    prepared = prepare_hessian(torch.eye(64, dtype=torch.float64))
    with pytest.raises(WeightsError, match="Hessian of 64 columns"):
        gptq_quantize(torch.randn(8, 32), prepared, Int4Format(32))
    with pytest.raises(WeightsError, match="even"):
        gptq_quantize(torch.randn(8, 63), prepare_hessian(torch.eye(63, dtype=torch.float64)), Int4Format(32))


@pytest.mark.parametrize("group", [32, 128])
def test_symmetric_grid_is_compressed_tensors_and_packs(group: int) -> None:
    """symmetric=True: with H = I the codes and scales are `symmetric_int4`'s (compressed-tensors' RTN)
    bit for bit; on correlated inputs the output error is lower; the result packs as pack-quantized
    and reads back to the same weight."""
    from backend.compressed_tensors import PackQuantizedWriter, symmetric_int4

    w = torch.randn(24, 256) * torch.rand(24, 1)
    fmt = Int4Format(group)
    got = gptq_quantize(w, prepare_hessian(torch.eye(256, dtype=torch.float64)), fmt, symmetric=True)
    rtn = symmetric_int4(w, group)
    assert all(torch.equal(got.stored.tensors[s], rtn.tensors[s]) for s in fmt.suffixes)
    dist = _Correlated(256)
    x = dist.sample(600)
    got = gptq_quantize(w, prepare_hessian(_hessian(x), act_order=True), fmt, symmetric=True)
    assert not got.stored.tensors["zeros"].any()
    rtn_w = fmt.dequantize(rtn)
    assert (x @ w.t() - x @ got.dequantized.t()).norm() < 0.8 * (x @ w.t() - x @ rtn_w.t()).norm()
    writer = PackQuantizedWriter(group)
    packed = writer.pack(got.stored)
    assert set(packed.tensors) == {"weight_packed", "weight_scale", "weight_shape"}
    assert torch.equal(writer.dequantize(packed), got.dequantized)
    with pytest.raises(WeightsError, match="divisible by the group size"):
        gptq_quantize(torch.randn(4, 96), prepare_hessian(torch.eye(96, dtype=torch.float64)), Int4Format(64),
                      symmetric=True)


@pytest.mark.parametrize("symmetric", [False, True])
def test_static_groups_and_clip_search(symmetric: bool) -> None:
    """Static groups with H = I are RTN's grid again; the clip search (range shrinks weighted by
    diag H) never has a larger weighted rounding error than RTN per row and group, and with
    correlated inputs still beats RTN's output error."""
    from backend.compressed_tensors import symmetric_int4

    w = torch.randn(32, 256) * torch.rand(32, 1) + 0.3 * torch.randn(32, 1)
    fmt = Int4Format(64)
    rtn = symmetric_int4(w, 64) if symmetric else fmt.quantize(w)
    eye = prepare_hessian(torch.eye(256, dtype=torch.float64))
    static = gptq_quantize(w, eye, fmt, symmetric=symmetric, static_groups=True)
    assert all(torch.equal(static.stored.tensors[s], rtn.tensors[s]) for s in fmt.suffixes)
    clipped = gptq_quantize(w, eye, fmt, symmetric=symmetric, clip=True)
    per_group = lambda q: ((q - w) ** 2).view(32, 4, 64).sum(-1)  # noqa: E731
    assert (per_group(clipped.dequantized) <= per_group(fmt.dequantize(rtn)) + 1e-6).all()
    assert (per_group(clipped.dequantized) < per_group(fmt.dequantize(rtn))).any()
    dist = _Correlated(256)
    x = dist.sample(600)
    got = gptq_quantize(w, prepare_hessian(_hessian(x), act_order=True), fmt, symmetric=symmetric, clip=True)
    assert torch.equal(fmt.dequantize(got.stored), got.dequantized)
    assert (x @ w.t() - x @ got.dequantized.t()).norm() < 0.8 * (x @ w.t() - x @ fmt.dequantize(rtn).t()).norm()
