"""Quantise-and-store: the Triton kernel against its torch reference, and the FP8 format's numerics.

CPU runs interpret the kernel (TRITON_INTERPRET=1). The interpreter's float32 ->
float8_e4m3fn cast is not round-to-nearest-even: it rounds ties away from zero,
truncates in e4m3's subnormal range, and when rounding up carries into the
exponent it drops the carry (0.4989 -> 0.25 instead of 0.5). So interpreted runs
accept, in at most 10% of elements, a value one fp8 step off or rounded toward
zero by at most 2x; exponents must be identical. CUDA runs must match the
reference byte for byte. The interpreter's float32 -> bfloat16 cast truncates, so
interpreted BF16 stores of float32 input allow one bf16 step toward zero.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: CPU runs interpret the kernels

import pytest
import torch

triton = pytest.importorskip("triton")
pytest.importorskip("numpy")  # the interpreter is numpy-backed

from kernels.kv_store import (FP8_MAX, FP8_MAX_EXP, FP8_MIN_EXP, dequantize_fp8_ref, quantize_fp8_ref,  # noqa: E402
                              store_kv, store_kv_ref)

INTERPRET = triton.knobs.runtime.interpret
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="CPU runs need TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
        INTERPRET or not torch.cuda.is_available(), reason="needs a CUDA device and TRITON_INTERPRET=0")]),
]
FP8_SUBNORMAL_STEP = 2.0 ** -9
MAX_INTERPRETER_MISROUNDED = 0.10  # share of fp8 elements the interpreter may round toward zero


@pytest.fixture
def seed() -> int:
    """Fresh inputs each run; the seed is in failure messages to replay one."""
    value = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(value)
    return value


def random_kv(num_tokens: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """randn with each (token, head) scaled by 2**U(-10, 10): amax from ~1e-3 to ~1e3, scales far from 1."""
    x = torch.randn(num_tokens, num_kv_heads, head_dim)
    return x * torch.exp2(torch.empty(num_tokens, num_kv_heads, 1).uniform_(-10, 10))


def edge_rows(head_dim: int) -> torch.Tensor:
    """[6, head_dim] rows whose amax sits on the exponent's edges (random signs and fill)."""
    amaxes = [FP8_MAX * 2.0 ** 5,  # exactly 448 * 2**k: e = k
              FP8_MAX * 2.0 ** -3 * (1 + 2.0 ** -23),  # one float32 step above: e = k + 1
              FP8_MAX * 2.0 ** 20 * (1 + 2.0 ** -23),  # where a float32 log2 rounds down to k
              1e-30,  # below 448 * 2**-64: e clamps to -64
              1e25,  # above 448 * 2**63: e clamps to 63, values saturate at 448
              0.0]  # e = -64, all zeros
    rows = torch.rand(len(amaxes), head_dim) * torch.where(torch.rand(len(amaxes), head_dim) < 0.5, -1.0, 1.0)
    rows = rows * torch.tensor(amaxes).unsqueeze(1)
    rows[torch.arange(len(amaxes)), torch.randint(head_dim, (len(amaxes),))] = torch.tensor(amaxes)
    return rows


def new_cache(num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
              device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """K/V pages (and int8 exponents for FP8) full of random bytes, so an untouched slot is recognisable."""
    shape = (num_pages, page_size, num_kv_heads, head_dim)  # [num_pages, PAGE_SIZE, num_kv_heads, head_dim]
    if dtype == torch.float8_e4m3fn:
        k_cache, v_cache = (torch.randint(0, 256, shape, dtype=torch.uint8).view(dtype) for _ in range(2))
        k_scale, v_scale = (torch.randint(-128, 128, shape[:3], dtype=torch.int8) for _ in range(2))
    else:
        k_cache, v_cache = (torch.randn(shape).to(dtype) for _ in range(2))
        k_scale = v_scale = None
    move = (lambda t: None if t is None else t.to(device))
    return move(k_cache), move(v_cache), move(k_scale), move(v_scale)


def raw(t: torch.Tensor) -> torch.Tensor:
    """Bytes-exact view for comparisons (float8 has no CPU `==`)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def fp8_step(x: torch.Tensor) -> torch.Tensor:
    """Spacing of float8_e4m3fn values at |x| (float32 x holding fp8 values)."""
    _, p = torch.frexp(x.abs())  # |x| in [2**(p-1), 2**p): 3 mantissa bits give steps of 2**(p-4)
    return torch.where(x.abs() < 2.0 ** -6, FP8_SUBNORMAL_STEP, torch.ldexp(torch.ones_like(x), p - 4))


def assert_fp8_values_match(got: torch.Tensor, want: torch.Tensor, seed: int) -> None:
    """Stored fp8 bytes (uint8) under equal exponents: compare the fp8 values."""
    if not INTERPRET:
        assert torch.equal(got, want), f"seed {seed}"
        return
    a, b = got.view(torch.float8_e4m3fn).float(), want.view(torch.float8_e4m3fn).float()
    off = a != b
    # the interpreter's cast: one step either way (it rounds ties away from zero and truncates
    # subnormals), or toward zero by up to 2x (a dropped carry into the exponent)
    near = (a - b).abs() <= fp8_step(b)
    toward_zero = (a * b >= 0) & (a.abs() < b.abs()) & (a.abs() >= b.abs() / 2 - FP8_SUBNORMAL_STEP)
    allowed = near | toward_zero
    assert bool((allowed | ~off).all()), f"seed {seed}: {a[off & ~allowed][:8]} vs {b[off & ~allowed][:8]}"
    assert off.float().mean() <= MAX_INTERPRETER_MISROUNDED, f"seed {seed}: {off.float().mean():.3f} misrounded"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", [64, 48])
@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16])
def test_fp8_store_matches_reference(device: str, head_dim: int, input_dtype: torch.dtype, seed: int) -> None:
    num_pages, page_size, num_kv_heads, num_tokens = 8, 16, 2, 37
    k = random_kv(num_tokens, num_kv_heads, head_dim)
    v = random_kv(num_tokens, num_kv_heads, head_dim)
    k[:6, 0] = edge_rows(head_dim)
    v[-6:, 1] = edge_rows(head_dim)
    k, v = k.to(device, input_dtype), v.to(device, input_dtype)
    slots = torch.randperm(num_pages * page_size)[:num_tokens].to(device)
    before = new_cache(num_pages, page_size, num_kv_heads, head_dim, torch.float8_e4m3fn, device)
    got = [t.clone() for t in before]
    want = [t.clone() for t in before]

    store_kv(k, v, *got, slots)
    store_kv_ref(k, v, *want, slots)

    pages, offsets = slots // page_size, slots % page_size
    for got_q, got_e, want_q, want_e in ((got[0], got[2], want[0], want[2]), (got[1], got[3], want[1], want[3])):
        assert torch.equal(got_e, want_e), f"seed {seed}: exponents differ"
        assert_fp8_values_match(raw(got_q)[pages, offsets], raw(want_q)[pages, offsets], seed)
    written = torch.zeros(num_pages * page_size, dtype=torch.bool, device=device)
    written[slots] = True
    written = written.view(num_pages, page_size)
    for g, b in zip(got, before):
        assert torch.equal(raw(g)[~written], raw(b)[~written]), f"seed {seed}: an untouched slot changed"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16])
def test_plain_store_matches_reference(device: str, cache_dtype: torch.dtype, input_dtype: torch.dtype,
                                       seed: int) -> None:
    num_pages, page_size, num_kv_heads, head_dim, num_tokens = 6, 16, 2, 64, 29
    k = random_kv(num_tokens, num_kv_heads, head_dim).to(device, input_dtype)
    v = random_kv(num_tokens, num_kv_heads, head_dim).to(device, input_dtype)
    slots = torch.randperm(num_pages * page_size)[:num_tokens].to(device)
    before = new_cache(num_pages, page_size, num_kv_heads, head_dim, cache_dtype, device)
    got = [t.clone() for t in before[:2]]
    want = [t.clone() for t in before[:2]]

    store_kv(k, v, *got, None, None, slots)
    store_kv_ref(k, v, *want, None, None, slots)

    rounds = INTERPRET and cache_dtype.itemsize < input_dtype.itemsize  # the interpreter truncates here
    for g, w in zip(got, want):
        if rounds:
            torch.testing.assert_close(g.float(), w.float(), rtol=2.0 ** -7, atol=0, msg=f"seed {seed}")
        else:
            assert torch.equal(g, w), f"seed {seed}"
    written = torch.zeros(num_pages * page_size, dtype=torch.bool, device=device)
    written[slots] = True
    written = written.view(num_pages, page_size)
    for g, b in zip(got, before[:2]):
        assert torch.equal(g[~written], b[~written]), f"seed {seed}: an untouched slot changed"


def test_fp8_exponent_is_the_smallest_that_fits(seed: int) -> None:
    x = torch.cat([random_kv(500, 1, 64).squeeze(1), edge_rows(64)])
    q, e = quantize_fp8_ref(x)
    amax = x.abs().amax(dim=-1)
    e = e.long()
    assert int(e.min()) >= FP8_MIN_EXP and int(e.max()) <= FP8_MAX_EXP
    inside = (e > FP8_MIN_EXP) & (e < FP8_MAX_EXP)
    # smallest e with amax * 2**-e <= 448 (power-of-two scaling is exact in float32)
    assert bool((torch.ldexp(amax, -e.float()) <= FP8_MAX)[inside].all()), f"seed {seed}"
    assert bool((torch.ldexp(amax, 1 - e.float()) > FP8_MAX)[inside].all()), f"seed {seed}"
    # that is ceil(log2(amax / 448)), evaluated here in float64
    expected = torch.ceil(torch.log2(amax.double() / FP8_MAX)).clamp(FP8_MIN_EXP, FP8_MAX_EXP)
    expected[amax == 0] = FP8_MIN_EXP
    assert torch.equal(e, expected.long()), f"seed {seed}"
    assert e[-1] == FP8_MIN_EXP and bool((q[-1].float() == 0).all())  # the all-zero edge row
    assert e[-2] == FP8_MAX_EXP and q[-2].float().abs().max() == FP8_MAX  # saturates, never NaN


def test_fp8_round_trip_error_is_within_e4m3_precision(seed: int) -> None:
    x = random_kv(400, 2, 64)
    q, e = quantize_fp8_ref(x)
    back = dequantize_fp8_ref(q, e)
    # 3 mantissa bits: relative error <= 2**-4 while x * 2**-e is normal in e4m3 (>= 2**-6);
    # below that the absolute step is 2**-9 * 2**e, half of it at most
    bound = torch.maximum(x.abs() * 2.0 ** -4, torch.ldexp(torch.tensor(2.0 ** -10), e.float()).unsqueeze(-1))
    assert bool(((back - x).abs() <= bound).all()), f"seed {seed}: worst {((back - x).abs() / bound).max():.3f}"
    # and the error is mostly well inside that bound (a broken rounding mode would sit at it)
    rel = ((back - x).abs() / x.abs())[x.abs() >= torch.ldexp(torch.tensor(2.0 ** -6), e.float()).unsqueeze(-1)]
    assert float(rel.mean()) < 2.0 ** -5, f"seed {seed}: mean relative error {float(rel.mean()):.4f}"


def test_rejects_mismatched_arguments() -> None:
    k_cache, v_cache, k_scale, v_scale = new_cache(4, 16, 2, 64, torch.float8_e4m3fn, "cpu")
    k = v = torch.randn(3, 2, 64)
    slots = torch.tensor([0, 17, 40])
    with pytest.raises(ValueError, match="k_scale"):
        store_kv(k, v, k_cache, v_cache, None, None, slots)
    with pytest.raises(ValueError, match="int8"):
        store_kv(k, v, k_cache, v_cache, k_scale.float(), v_scale.float(), slots)
    with pytest.raises(ValueError, match="slots"):
        store_kv(k, v, k_cache, v_cache, k_scale, v_scale, slots.int())
    with pytest.raises(ValueError, match=r"k, v must be"):
        store_kv(torch.randn(3, 1, 64), torch.randn(3, 1, 64), k_cache, v_cache, k_scale, v_scale, slots)
    bf16 = new_cache(4, 16, 2, 64, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="no scales"):
        store_kv(k, v, bf16[0], bf16[1], k_scale, v_scale, slots)
