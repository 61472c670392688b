"""W4A16 GEMM: the Triton kernel (both paths) and its torch reference against the dequantised weight.

Shapes are odd on purpose: N not a multiple of the tile, K ending in a partial group
(K = 66, 130, 200 at g = 32 / 128), M of 1 .. 8 (split-K GEMV) and 9, 17, 33 (tiled),
with split-K forced to 1 and 3 on the GEMV path. Weights are scaled per row by
2**U(-6, 6), so group scales sit far from 1. CPU runs interpret the kernel.

Tolerances, elementwise, in units of mag = |x| @ |W|.T (what summation error scales with):
- float32 x: 1e-5 * mag + 1e-6 (both sides float32; the sums differ only in order).
- bfloat16 x against the float32 product of the same bf16 x: 2**-7 * mag, which allows the
  output rounded to bf16 (the interpreter truncates: 1 ulp) and, on a GPU, the dequantised
  weight rounded to bf16 before the dot (another 2**-9 per product).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: CPU runs interpret the kernels

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("numpy")  # the interpreter is numpy-backed

from kernels.w4a16_gemm import (GEMV_MAX_M, dequantize_int4_ref, quantize_int4_ref, unpack_int4_ref,  # noqa: E402
                                w4a16_gemm, w4a16_gemm_ref)
from tests.kernels.test_kv_store import DEVICES, seed  # noqa: E402,F401  (seed is a fixture)

SHAPES = [  # (M, N, K): GEMV rows first, then tiled
    (1, 33, 66), (3, 40, 200), (8, 17, 130), (9, 50, 130), (17, 33, 66), (33, 70, 200)]


def random_weight(n: int, k: int, device: str) -> torch.Tensor:
    return (torch.randn(n, k) * torch.exp2(torch.empty(n, 1).uniform_(-6, 6))).to(device)


def mag(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.float().abs() @ w.abs().t()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_float32_matches_the_dequantised_weight(device: str, group: int, m: int, n: int, k: int, seed: int) -> None:
    q, s, z = quantize_int4_ref(random_weight(n, k, device), group)
    w = dequantize_int4_ref(q, s, z, group, k)
    assert s.float().max() / s.float().min() > 100  # scales far from 1, over orders of magnitude
    x = torch.randn(m, k, device=device)
    expected = x @ w.t()
    tol = 1e-5 * mag(x, w) + 1e-6
    # the GEMV's own choices, one K range, three, and the tiles and warps a benchmark sweeps: a tile of 16 bytes
    # a row (several tiles a group at g = 128), of 64 (several groups a tile at g = 32)
    variants = [(None, None, None, None), (1, None, None, None), (3, None, None, None), (1, 32, 2, 16),
                (2, 64, 8, 64), (3, 8, 4, 16)] if m <= GEMV_MAX_M else [(None, None, None, None)]
    for split_k, block_n, warps, block_b in variants:
        got = w4a16_gemm(x, q, s, z, group, split_k=split_k, block_n=block_n, num_warps=warps, block_b=block_b)
        assert got.shape == (m, n) and got.dtype == torch.float32
        assert ((got - expected).abs() <= tol).all(), f"seed {seed} split_k {split_k} block_n {block_n} {block_b}"
    assert ((w4a16_gemm_ref(x, q, s, z, group) - expected).abs() <= tol).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m,n,k,group", [(1, 33, 66, 32), (5, 40, 200, 128), (17, 50, 130, 32)])
def test_bfloat16_activations(device: str, m: int, n: int, k: int, group: int, seed: int) -> None:
    q, s, z = quantize_int4_ref(random_weight(n, k, device), group)
    w = dequantize_int4_ref(q, s, z, group, k)
    x = torch.randn(m, k, device=device).to(torch.bfloat16)
    got = w4a16_gemm(x, q, s, z, group)
    assert got.dtype == torch.bfloat16
    expected = x.float() @ w.t()
    assert ((got.float() - expected).abs() <= 2.0 ** -7 * mag(x, w) + 1e-6).all(), f"seed {seed}"


def test_packing_is_low_nibble_first() -> None:
    codes = torch.tensor([[1, 2, 15, 0, 7, 8]])
    w = (codes - 8).float()  # scale 1, zero 0: codes come back as they are
    q, s, z = quantize_int4_ref(torch.cat([w, torch.tensor([[-8.0] * 2 + [7.0] * 4])]), 32)
    assert q[0].tolist() == [1 | 2 << 4, 15 | 0 << 4, 7 | 8 << 4]
    assert torch.equal(unpack_int4_ref(q)[0], codes[0].int())


@pytest.mark.parametrize("group", [32, 128])
def test_quantisation_error_is_half_a_step(group: int, seed: int) -> None:
    n, k = 24, 200  # a partial last group at both sizes
    w = random_weight(n, k, "cpu")
    q, s, z = quantize_int4_ref(w, group)
    assert q.shape == (n, k // 2) and s.shape == z.shape == (n, -(-k // group))
    err = (dequantize_int4_ref(q, s, z, group, k) - w).abs()
    step = s.float().repeat_interleave(group, dim=1)[:, :k]
    zero = z.float().abs().repeat_interleave(group, dim=1)[:, :k]
    # half a step, plus what rounding the scale and zero to bf16 moves the grid (<= 2**-9 relative each)
    assert (err <= 0.5 * step + 16 * 2.0 ** -9 * step + 2.0 ** -9 * zero + 1e-12).all(), f"seed {seed}"
    # every group's extremes are (nearly) hit: the grid spans the group's range
    assert (unpack_int4_ref(q).amax(1) >= 14).all() and (unpack_int4_ref(q).amin(1) <= 1).all()


def test_constant_groups_are_exact() -> None:
    w = torch.full((16, 64), 0.3125)
    w[:, 32:] = -2.5
    q, s, z = quantize_int4_ref(w, 32)
    assert torch.equal(dequantize_int4_ref(q, s, z, 32), w)


def test_launcher_checks_shapes() -> None:
    q, s, z = quantize_int4_ref(torch.randn(16, 64), 32)
    with pytest.raises(ValueError, match="qweight"):
        w4a16_gemm(torch.randn(2, 62), q, s, z, 32)
    with pytest.raises(ValueError, match="scales"):
        w4a16_gemm(torch.randn(2, 64), q, s[:, :1], z, 32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n,k,group", [(33, 64, 32), (40, 200, 128), (17, 136, 16), (9, 520, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_words_forms_match_the_dequantised_weight(device: str, n: int, k: int, group: int, dtype: torch.dtype,
                                                  seed: int) -> None:
    """The GEMV's words forms (int32 words of codes, nibbles decoded in place; bfloat16 x read in pairs), with
    and without the next tile in flight: K a multiple of 8 ending in a partial tile and group, groups of 16
    (chunks of two words), K split and not, against the same tolerances as the bytes form's."""
    q, s, z = quantize_int4_ref(random_weight(n, k, device), group)
    w = dequantize_int4_ref(q, s, z, group, k)
    x = torch.randn(1, k, device=device).to(dtype)
    expected = x.float() @ w.t()
    tol = (1e-5 if dtype == torch.float32 else 2.0 ** -7) * mag(x, w) + 1e-6
    for form in ("words", "words-prefetch"):
        for split_k, block_n, block_b in [(None, None, None), (1, 16, 16), (3, 8, 64), (2, 32, 32)]:
            got = w4a16_gemm(x, q, s, z, group, split_k=split_k, block_n=block_n, block_b=block_b, kernel=form)
            assert got.dtype == dtype
            assert ((got.float() - expected).abs() <= tol).all(), f"seed {seed} {form} {split_k} {block_n} {block_b}"


def test_words_forms_refuse_what_they_cannot_read() -> None:
    q, s, z = quantize_int4_ref(torch.randn(8, 68), 32)  # K = 68: not whole words of 8 columns
    with pytest.raises(ValueError, match="multiple of 8"):
        w4a16_gemm(torch.randn(1, 68), q, s, z, 32, kernel="words")
    q, s, z = quantize_int4_ref(torch.randn(8, 64), 32)
    with pytest.raises(ValueError, match="M = 1"):
        w4a16_gemm(torch.randn(2, 64), q, s, z, 32, kernel="words")
    with pytest.raises(ValueError, match="at least 16 bytes"):
        w4a16_gemm(torch.randn(1, 64), q, s, z, 32, kernel="words", block_b=8)
    with pytest.raises(ValueError, match="kernel must be one of"):
        w4a16_gemm(torch.randn(1, 64), q, s, z, 32, kernel="nibbles")
