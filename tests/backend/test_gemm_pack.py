"""Bfloat16 weights packed once for oneDNN (`backend/gemm_pack.py`): a `Linear` packs its weight at its first
GEMM of enough rows and then computes what the plain GEMM computes (up to summation order), with its bias;
packing stops at the process's budget and `EDGESERVE_PREFILL_PACK=0` turns it off."""

from __future__ import annotations

import gc
import time

import pytest
import torch

from backend import gemm_pack
from backend.gemm_widen import widening_pays
from backend.linear import Linear

pytestmark = pytest.mark.skipif(not gemm_pack.available(), reason="no oneDNN packed linear, or no native bfloat16")


@pytest.fixture
def fresh_budget(monkeypatch: pytest.MonkeyPatch):
    """The process's pack budget read anew from the environment, nothing packed yet; no widening."""
    monkeypatch.setattr(gemm_pack, "_budget", None)
    monkeypatch.setattr(gemm_pack, "_packed", 0)
    monkeypatch.setenv("EDGESERVE_BF16_WIDEN", "0")
    widening_pays.cache_clear()
    yield monkeypatch
    gc.collect()  # the test's linears give their bytes back before the counter is restored
    widening_pays.cache_clear()


def _exact(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().t()
    return y if b is None else y + b.double()


@pytest.mark.parametrize("bias", [False, True])
def test_a_linear_packs_at_its_first_large_call_and_computes_the_plain_gemm(fresh_budget, bias: bool) -> None:
    w = torch.randn(96, 200).bfloat16()
    b = torch.randn(96).bfloat16() if bias else None
    lin = Linear(w, b)
    rows = max(lin.gemv_rows + 1, 200)  # past the C GEMV: torch's bfloat16 GEMM
    assert gemm_pack.takes(rows)
    x = torch.randn(rows, 200).bfloat16()
    assert lin.packed is None
    y = lin(x)
    assert lin.packed is not None and gemm_pack.packed_bytes() == w.nbytes
    assert lin.pack_bytes == w.nbytes
    plain = torch.nn.functional.linear(x, w, b)
    # float32 sums rounded once to bfloat16, as the plain GEMM's: one bfloat16 step apart at most
    step = torch.maximum(y.float().abs(), plain.float().abs()) * 2.0 ** -7 + 1e-6
    assert bool(((y.float() - plain.float()).abs() <= step).all())
    torch.testing.assert_close(y.double(), _exact(x, w, b), rtol=2 ** -7, atol=1e-2)
    gemm_pack.use_packs = False  # the process-wide switch: the plain weight again
    try:
        assert torch.equal(lin(x), plain)
    finally:
        gemm_pack.use_packs = True


def test_packing_stops_at_the_budget_and_can_be_turned_off(fresh_budget) -> None:
    w = torch.randn(64, 48).bfloat16()
    x = torch.randn(300, 48).bfloat16()
    fresh_budget.setattr(gemm_pack, "_budget", w.nbytes)  # room for one pack
    first, second = Linear(w), Linear(w.clone())
    first(x), second(x)
    assert first.packed is not None and second.packed is None  # over the budget: the plain GEMM
    assert torch.equal(second(x), torch.nn.functional.linear(x, w))
    del first  # a collected linear gives its pack's bytes back
    gc.collect()
    assert gemm_pack.packed_bytes() == 0
    third = Linear(w.clone())
    third(x)
    assert third.packed is not None
    fresh_budget.setattr(gemm_pack, "_budget", None)
    fresh_budget.setenv("EDGESERVE_PREFILL_PACK", "0")
    off = Linear(w)
    off(x)
    assert off.packed is None and gemm_pack.budget_bytes() == 0


def test_small_and_large_calls_and_float32_weights_are_not_packed(fresh_budget) -> None:
    w = torch.randn(64, 48)
    f32 = Linear(w)
    f32(torch.randn(300, 48))
    assert f32.packed is None
    bf16 = Linear(w.bfloat16())
    for rows in (gemm_pack.MIN_ROWS - 1, gemm_pack.MAX_ROWS):
        x = torch.randn(rows, 48).bfloat16()
        assert torch.equal(bf16._dense(x), torch.nn.functional.linear(x, w.bfloat16()))
    assert bf16.packed is None and gemm_pack.packed_bytes() == 0


def test_a_served_engine_packs_its_prompt_weights_before_the_first_request(fresh_budget, tmp_path) -> None:
    """The async engine's thread packs every bfloat16 prompt linear when it starts; a float32 model packs none."""
    from backend.async_engine import AsyncEngine
    from backend.engine import EngineConfig, LLMEngine
    from tests.backend.tiny_models import write_tiny_model

    path = write_tiny_model(tmp_path / "m", "llama", seed=3)
    for dtype, packed in (("float32", False), ("bfloat16", True)):
        engine = LLMEngine.from_pretrained(path, EngineConfig(dtype=dtype, kv_cache_bytes=2**20))
        served = AsyncEngine(engine)
        served.start()
        try:
            deadline = time.monotonic() + 30
            linears = [op for layer in engine.model.phase_layers["prefill"] for op in layer.linears()]
            while packed and not all(op.packed is not None for op in linears) and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            served.shutdown()
        assert all((op.packed is not None) == packed for op in linears), dtype
