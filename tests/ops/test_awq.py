"""AWQ-style input scaling (ops/awq.py): the search never loses to no scaling and wins where a few input
channels carry large activations; the fold into a norm is exact in the norm's dtype."""

from __future__ import annotations

import torch

from backend.layers.norm import rms_norm
from ops.awq import fake_quant, fold_into_norm, input_stats, search_scales


def _salient_inputs(n: int, k: int, channels: torch.Tensor) -> torch.Tensor:
    """Activations where a few `channels` are ~30x the others (as LLM activations have outlier channels)."""
    x = torch.randn(n, k)
    x[:, channels] *= 30
    return x


def test_search_lowers_output_error_on_salient_channels_and_never_loses() -> None:
    k, out, group = 256, 96, 128
    channels = torch.randperm(k)[:4]
    x, w = _salient_inputs(2048, k, channels), torch.randn(out, k) * 0.05
    h, mean = input_stats(x)
    quantise = fake_quant(group, symmetric=False)
    found = search_scales(h, mean, [w], quantise)
    assert found.alpha > 0 and found.error < 0.9 * found.error_unscaled
    s = found.scales
    scaled = quantise(w * s) / s
    err = lambda inputs, q: (inputs @ (w - q).t()).norm().item()  # noqa: E731
    fresh = _salient_inputs(2048, k, channels)  # new rows of the same distribution
    assert err(fresh, scaled) < 0.9 * err(fresh, quantise(w))
    # uniform inputs: nothing to gain, and the search may keep alpha = 0 (its error never exceeds it)
    plain = search_scales(*input_stats(torch.randn(2048, k)), [w], quantise)
    assert plain.error <= plain.error_unscaled


def test_fake_quant_is_the_formats_rtn() -> None:
    from backend.compressed_tensors import asymmetric_int4, symmetric_int4
    from backend.weight_formats import Int4Format

    w = torch.randn(16, 192)  # a partial last group at 128 on our grid
    assert torch.equal(fake_quant(128, False)(w), Int4Format(128).dequantize(Int4Format(128).quantize(w)))
    w = torch.randn(16, 256)
    assert torch.equal(fake_quant(128, True)(w), Int4Format(128).dequantize(symmetric_int4(w, 128)))
    assert torch.equal(fake_quant(128, False, integer_zero=True)(w), Int4Format(128).dequantize(asymmetric_int4(w, 128)))


def test_fold_into_norm_is_exact_in_the_norms_dtype() -> None:
    hidden = torch.randn(5, 64)
    norm = (torch.rand(64) + 0.5).to(torch.bfloat16)
    norm[3] = 0
    scales = torch.rand(64) * 4 + 0.1
    new, s_eff = fold_into_norm(norm, scales)
    assert new.dtype == torch.bfloat16 and s_eff[3] == 1
    w = torch.randn(32, 64)
    before = rms_norm(hidden, norm.float(), 1e-6) @ w.t()
    after = rms_norm(hidden, new.float(), 1e-6) @ (w * s_eff).t()
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    live = norm != 0  # the rounded weight realises nearly the searched scales
    assert (s_eff[live] / scales[live] - 1).abs().max() < 2 ** -7
