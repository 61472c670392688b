"""SwiGLU's activation kernel (kernels/cpu/silu_mul_bf16.c) against torch's `F.silu(gate).mul_(up)` on fresh random
bfloat16 rows: the same bits but for elements on a bfloat16 rounding boundary (one step then), across the
activation range (large negative gates whose silu is a float32 subnormal or zero, large positive ones, zeros);
None for what it does not handle; the MLP taking it through `backend.layers.swiglu`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu_silu_mul import available, build_error, silu_mul_bf16
from tests.kernels.test_kv_store import seed  # noqa: F401  (fixture)

pytestmark = pytest.mark.skipif(not available(), reason=f"SwiGLU kernel not built: {build_error()}")


def _reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def _assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-equal but for at most 0.1% of elements, each within one bfloat16 step (of the larger magnitude)."""
    differ = got.view(torch.int16) != want.view(torch.int16)
    assert differ.float().mean().item() <= 1e-3, f"{differ.sum().item()} of {got.numel()} differ"
    g, w = got[differ].float(), want[differ].float()
    step = torch.maximum(g.abs(), w.abs()) * 2.0 ** -7
    assert bool(((g - w).abs() <= step).all()), list(zip(g.tolist()[:5], w.tolist()[:5]))


@pytest.mark.parametrize("rows,inter", [(1, 1536), (3, 17), (32, 1536), (5, 1)])
def test_matches_torch(rows: int, inter: int, seed: int) -> None:
    gate_up = (torch.randn(rows, 2 * inter) * 4).to(torch.bfloat16)
    _assert_matches(silu_mul_bf16(gate_up), _reference(gate_up))


def test_the_whole_range(seed: int) -> None:
    """Gates from -120 to 120 (silu of the most negative ones underflows to float32 subnormals, then to -0),
    ups of every magnitude, exact zeros of both signs."""
    gate = torch.linspace(-120, 120, 4096) * torch.rand(4096).add(0.5)
    gate[::97] = 0.0
    gate[1::97] = -0.0
    up = torch.randn(4096) * torch.exp2(torch.randint(-20, 20, (4096,)).float())
    gate_up = torch.cat([gate, up]).view(1, -1).to(torch.bfloat16)
    _assert_matches(silu_mul_bf16(gate_up), _reference(gate_up))


@pytest.mark.parametrize("rows,inter", [(1, 1536), (3, 17), (32, 1536)])
def test_once_rounds_torchs_float32_result(rows: int, inter: int, seed: int) -> None:
    """`once`: torch's ops on the rows widened to float32, the product cast to bfloat16 (one rounding)."""
    gate_up = (torch.randn(rows, 2 * inter) * 4).to(torch.bfloat16)
    want = _reference(gate_up.float()).bfloat16()
    got = silu_mul_bf16(gate_up, once=True)
    _assert_matches(got, want)
    assert not torch.equal(got, silu_mul_bf16(gate_up)) or rows * inter < 100  # two roundings differ somewhere


def test_declines_what_it_does_not_handle() -> None:
    x = torch.randn(4, 64).to(torch.bfloat16)
    assert silu_mul_bf16(x.float()) is None
    assert silu_mul_bf16(x.t()) is None  # strided
    assert silu_mul_bf16(x[0]) is None  # 1-D
    assert silu_mul_bf16(x[:, :63].contiguous()) is None  # odd width
    assert silu_mul_bf16(torch.empty(0, 64, dtype=torch.bfloat16)).shape == (0, 32)


def test_the_mlp_takes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import backend.layers.mlp as mlp_module
    import backend.layers.swiglu as swiglu_module

    calls = []
    monkeypatch.setattr(swiglu_module, "silu_mul_bf16", lambda x: calls.append(x.shape) or silu_mul_bf16(x))
    hidden, inter = 16, 24
    w_gate_up = (torch.randn(2 * inter, hidden) * 0.3).to(torch.bfloat16)
    w_down = (torch.randn(hidden, inter) * 0.3).to(torch.bfloat16)
    x = torch.randn(3, hidden).to(torch.bfloat16)
    gate_up, down = (lambda t: F.linear(t, w_gate_up)), (lambda t: F.linear(t, w_down))
    out = mlp_module.mlp(gate_up, gate_up, down, down, x, 0)
    assert calls == [(3, 2 * inter)] and torch.equal(out, down(_reference(gate_up(x))))
