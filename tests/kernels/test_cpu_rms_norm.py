"""The bfloat16 RMSNorm kernel (kernels/cpu/rms_norm_bf16.c) against the torch ops it replaces, on fresh random
inputs over six decades of magnitude: within two bfloat16 ulps everywhere (one in the rounded normalised value
can become two in its product with the weight) and equal almost everywhere (the sums' order is the only
difference); zero rows, NaN, no rows, 3-D input; None for what it does not handle; and the model's `rms_norm`
taking it for bfloat16 rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from backend.layers.norm import rms_norm
from kernels.cpu_rms_norm import available, build_error, rms_norm_bf16
from tests.kernels.test_kv_store import seed  # noqa: F401  (fixture)

pytestmark = pytest.mark.skipif(not available(), reason=f"bf16 RMSNorm kernel not built: {build_error()}")


def _torch(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


def _near_midpoint(v: torch.Tensor, rel: float = 2.0 ** -17) -> torch.Tensor:
    """Whether float32 v lies within `rel` (relative) of the midpoint between the two bfloat16 values around it."""
    mid = torch.bitwise_or(torch.bitwise_and(v.view(torch.int32), -65536), 0x8000).view(torch.float32)
    return (v - mid).abs() <= rel * v.abs()


@pytest.mark.parametrize("n", [576, 960, 7, 2048])
@pytest.mark.parametrize("rows", [1, 3, 32])
def test_matches_the_torch_ops(rows: int, n: int, seed: int) -> None:
    for scale in (1e-3, 1e-1, 1.0, 10.0, 1e3):
        x = (torch.randn(rows, n) * scale).bfloat16()
        w = torch.randn(n).bfloat16()
        y, ref = rms_norm_bf16(x, w, 1e-5), _torch(x, w, 1e-5)
        ulps = _ulps(y, ref)
        # the normalised row is rounded to bfloat16 before the weight: one ulp there can be two in the product
        assert int(ulps.max()) <= 2, f"seed {seed}, scale {scale}: {int(ulps.max())} ulps"
        # equal except where the float32 normalised value sits on a bfloat16 rounding midpoint (the sums' order
        # moves the normaliser by a few float32 ulps, which decides such a tie): bfloat16 has 256 mantissas, so
        # one tie flips every element of that mantissa at once (seen: 18 of 2048 at scale 10, all x = ±103·2^k)
        off_tie = (ulps > 0) & ~_near_midpoint(F.rms_norm(x.float(), (n,), eps=1e-5))
        differing = int(off_tie.sum())
        assert differing <= max(1, ulps.numel() // 200), f"seed {seed}, scale {scale}: {differing} differ off ties"


def test_zero_rows_nan_and_shapes() -> None:
    w = torch.randn(64).bfloat16()
    x = torch.randn(2, 3, 64).bfloat16()
    x[0, 1] = 0.0  # normalised by sqrt(eps): zeros
    x[1, 2, 5] = float("nan")  # its row becomes NaN, the others not
    y, ref = rms_norm_bf16(x, w, 1e-6), _torch(x, w, 1e-6)
    assert y.shape == x.shape and y.dtype == torch.bfloat16
    assert torch.equal(y.isnan(), ref.isnan()) and y[1, 2].isnan().all() and not y[[0]].isnan().any()
    finite = ~ref.isnan()
    assert int(_ulps(y[finite], ref[finite]).max()) <= 1
    assert bool((y[0, 1] == 0).all())
    assert rms_norm_bf16(torch.empty(0, 64, dtype=torch.bfloat16), w, 1e-6).shape == (0, 64)


def test_declines_what_it_does_not_handle() -> None:
    x, w = torch.randn(4, 64).bfloat16(), torch.randn(64).bfloat16()
    assert rms_norm_bf16(x.float(), w.float(), 1e-6) is None  # float32: torch's fused op
    assert rms_norm_bf16(x, w.float(), 1e-6) is None
    assert rms_norm_bf16(x.t().contiguous().t(), w, 1e-6) is None  # strided
    assert rms_norm_bf16(x.view(4, 2, 32), torch.randn(2, 32).bfloat16(), 1e-6) is None  # per-head weight


def test_the_model_norm_takes_it_for_bfloat16_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    import backend.layers.norm as norm

    calls = []
    monkeypatch.setattr(norm, "rms_norm_bf16", lambda *a: calls.append(a) or rms_norm_bf16(*a))
    x, w = torch.randn(5, 576).bfloat16(), torch.randn(576).bfloat16()
    y = rms_norm(x, w, 1e-5)
    assert len(calls) == 1 and int(_ulps(y, _torch(x, w, 1e-5)).max()) <= 1
    rms_norm(x.view(5, 9, 64), torch.randn(9, 64).bfloat16(), 1e-5)  # q/k norm weight [heads, head_dim]: torch
    rms_norm(x.float(), w.float(), 1e-5)
    assert len(calls) == 2  # the per-head call asked and was declined; float32 never asked


@pytest.mark.parametrize("rows,n", [(1, 576), (32, 576), (3, 7)])
def test_add_then_norm_is_torchs_add_and_this_norm(rows: int, n: int, seed: int) -> None:
    """`add_rms_norm_bf16`: h updated in place exactly as torch's bfloat16 `add_` does it, the result exactly
    the plain kernel's on that h; the model's `add_rms_norm` takes it, and falls back to the two ops."""
    from backend.layers.norm import add_rms_norm
    from kernels.cpu_rms_norm import add_rms_norm_bf16

    for scale in (1e-2, 1.0, 1e2):
        h, a = (torch.randn(rows, n) * scale).bfloat16(), (torch.randn(rows, n) * scale).bfloat16()
        w = torch.randn(n).bfloat16()
        ref_h = h.clone().add_(a)
        y = add_rms_norm_bf16(h, a, w, 1e-5)
        assert torch.equal(h, ref_h), f"seed {seed}, scale {scale}: the add differs from torch's"
        assert torch.equal(y, rms_norm_bf16(ref_h, w, 1e-5))
        h2 = (torch.randn(rows, n) * scale).bfloat16()
        h3 = h2.clone()
        torch.testing.assert_close(add_rms_norm(h2, a, w, 1e-5), rms_norm(h3.add_(a), w, 1e-5), atol=0, rtol=0)
        assert torch.equal(h2, h3)
    h32, a32 = torch.randn(rows, n), torch.randn(rows, n)
    ref32 = h32 + a32
    torch.testing.assert_close(add_rms_norm(h32, a32, torch.ones(n), 1e-5), F.rms_norm(ref32, (n,), eps=1e-5))
    assert torch.equal(h32, ref32)  # float32: torch's ops, h updated too


def test_add_then_norm_leaves_h_alone_where_it_cannot_run() -> None:
    from kernels.cpu_rms_norm import add_rms_norm_bf16

    h = torch.randn(4, 64).bfloat16()
    before = h.clone()
    w = torch.randn(64).bfloat16()
    assert add_rms_norm_bf16(h, torch.randn(4, 64), w, 1e-5) is None  # float32 branch
    assert add_rms_norm_bf16(h, torch.randn(64, 4).bfloat16().t(), w, 1e-5) is None  # strided branch
    assert add_rms_norm_bf16(h, torch.randn(4, 64).bfloat16(), w.float(), 1e-5) is None
    assert torch.equal(h, before)
