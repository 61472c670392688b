"""The bfloat16 rotary embedding kernel (kernels/cpu/rope_bf16.c) against the torch ops it replaces and a float64
reference, on fresh random inputs: query/key heads strided inside a fused projection's rows, full and partial
rotation (dims past it copied exactly), the vector loop and its scalar tail, NaN kept; None for what it does
not handle; `RotaryEmbedding.apply` taking it for bfloat16 heads on the CPU."""

from __future__ import annotations

import pytest
import torch

from backend.rope import RotaryEmbedding
from kernels.cpu_rope import available, build_error, rope_bf16
from tests.kernels.test_kv_store import seed  # noqa: F401  (fixture)

pytestmark = pytest.mark.skipif(not available(), reason=f"bf16 rotary embedding kernel not built: {build_error()}")


def _torch(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """backend/rope.py's torch arithmetic: widen, complex product in float32, narrow; dims past 2P copied."""
    t, heads, dim = x.shape
    rot = 2 * freqs.shape[-1]
    pairs = torch.view_as_complex(x[..., :rot].float().reshape(t, heads, rot // 2, 2))
    return torch.cat([torch.view_as_real(pairs * freqs).reshape(t, heads, rot).to(x.dtype), x[..., rot:]], -1)


def _freqs(t: int, pairs: int) -> torch.Tensor:
    angles = torch.rand(t, 1, pairs) * 1000
    return torch.polar(torch.full_like(angles, 1.1), angles)  # a YaRN-like attention factor


@pytest.mark.parametrize("tokens,heads,dim,pairs", [(1, 12, 64, 32), (32, 12, 64, 32), (5, 3, 128, 32),
                                                    (7, 2, 40, 20), (4, 5, 22, 5), (3, 4, 64, 0)])
def test_matches_the_torch_ops_and_float64(tokens: int, heads: int, dim: int, pairs: int, seed: int) -> None:
    fused = (torch.randn(tokens, (heads + 3) * dim) * 4).bfloat16()  # q/k heads first, then other columns
    x = fused[:, : heads * dim].view(tokens, heads, dim)  # tokens strided, as in attention's split
    freqs = _freqs(tokens, pairs) if pairs else torch.ones(tokens, 1, 0, dtype=torch.complex64)
    y = rope_bf16(x, freqs)
    assert y is not None and y.is_contiguous() and y.shape == x.shape and y.dtype == torch.bfloat16
    assert torch.equal(y[..., 2 * pairs:], x[..., 2 * pairs:])  # copied, not rotated
    # every error is bfloat16's rounding of the result plus float32's of the two products, which shows where
    # they cancel: against float64, and against torch's ops (which round the products differently)
    a, b = x[..., : 2 * pairs: 2].double(), x[..., 1: 2 * pairs: 2].double()
    f = torch.view_as_real(freqs).double()
    c, d = f[..., 0], f[..., 1]
    exact = torch.stack([a * c - b * d, a * d + b * c], -1).reshape(tokens, heads, 2 * pairs)
    size = torch.stack([(a * c).abs() + (b * d).abs(), (a * d).abs() + (b * c).abs()], -1).reshape(exact.shape)
    got, ref = y[..., : 2 * pairs].double(), _torch(x, freqs)[..., : 2 * pairs].double()
    assert bool(((got - exact).abs() <= exact.abs() * 2.0 ** -8 + size * 2.0 ** -22).all()), f"seed {seed}"
    assert bool(((got - ref).abs() <= ref.abs() * 2.0 ** -7 + size * 2.0 ** -21).all()), f"seed {seed}"  # an ulp
    differing = int((got != ref).sum())
    assert differing <= max(1, got.numel() // 100), f"seed {seed}: {differing} of {got.numel()} differ from torch's"


def test_nan_stays_nan() -> None:
    x = torch.randn(2, 2, 32).bfloat16()
    x[1, 0, 3] = float("nan")
    y = rope_bf16(x, _freqs(2, 16))
    assert y[1, 0, 2:4].isnan().all() and not y[0].isnan().any() and not y[1, 1].isnan().any()


def test_none_for_what_it_does_not_handle() -> None:
    x = torch.randn(3, 4, 32).bfloat16()
    f = _freqs(3, 16)
    assert rope_bf16(x.float(), f) is None  # float32 heads
    assert rope_bf16(x[..., :16], _freqs(3, 8)) is None  # heads not contiguous within a token
    assert rope_bf16(x, f.to(torch.complex128)) is None
    assert rope_bf16(x, _freqs(3, 17)) is None  # more pairs than a head has
    assert rope_bf16(x, _freqs(1, 16)) is None  # one rotation for three tokens


def test_rotary_embedding_apply_takes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import backend.rope

    calls: list[tuple[int, ...]] = []
    monkeypatch.setattr(backend.rope, "rope_bf16", lambda x, f: calls.append(tuple(x.shape)) or rope_bf16(x, f))
    x, f = torch.randn(6, 3, 64).bfloat16(), _freqs(6, 32)
    torch.testing.assert_close(RotaryEmbedding.apply(x, f), _torch(x, f), atol=0, rtol=2 ** -7)
    RotaryEmbedding.apply(x.float(), f)  # float32 heads: the torch path, no call
    assert calls == [(6, 3, 64)]
