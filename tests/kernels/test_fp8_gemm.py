"""W8A16 FP8 GEMM: the Triton kernel and its torch reference against the dequantised weight.

Block scales in both layouts the runtime meets: 128 x 128 (checkpoints) and 1 x 128 (rows
expanded at load), on odd shapes whose edge blocks are partial (N = 130, 200; K = 72,
200, 260). Weights are scaled per row by 2**U(-8, 8), so block scales sit far from 1
and differ inside a block's rows. FP8 loads are exact in the interpreter.

Tolerances (mag = |x| @ |W|.T): float32 x 1e-5 * mag + 1e-6; bfloat16 x 2**-7 * mag
(bf16 output, truncated by the interpreter; bf16 dot operands on a GPU).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: CPU runs interpret the kernels

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("numpy")  # the interpreter is numpy-backed

from kernels.fp8_gemm import (FP8_MAX, dequantize_fp8_blocks_ref, fp8_gemm, fp8_gemm_ref,  # noqa: E402
                              quantize_fp8_blocks_ref)
from tests.kernels.test_kv_store import DEVICES, seed  # noqa: E402,F401  (seed is a fixture)

SHAPES = [(1, 130, 72), (7, 40, 200), (20, 200, 260), (33, 70, 128)]


def random_weight(n: int, k: int) -> torch.Tensor:
    return torch.randn(n, k) * torch.exp2(torch.empty(n, 1).uniform_(-8, 8))


def rowwise(scale: torch.Tensor, n: int) -> torch.Tensor:
    return scale.repeat_interleave(128, dim=0)[:n].contiguous()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows_per_scale", [128, 1])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_float32_matches_the_dequantised_weight(device: str, rows_per_scale: int, m: int, n: int, k: int,
                                                seed: int) -> None:
    q, scale = quantize_fp8_blocks_ref(random_weight(n, k))
    if rows_per_scale == 1:
        scale = rowwise(scale, n)
    block = (rows_per_scale, 128)
    q, scale = q.to(device), scale.to(device)
    w = dequantize_fp8_blocks_ref(q, scale, block)
    x = torch.randn(m, k, device=device)
    expected = x @ w.t()
    tol = 1e-5 * (x.abs() @ w.abs().t()) + 1e-6
    got = fp8_gemm(x, q, scale, block)
    assert got.shape == (m, n) and got.dtype == torch.float32
    assert ((got - expected).abs() <= tol).all(), f"seed {seed}"
    assert ((fp8_gemm_ref(x, q, scale, block) - expected).abs() <= tol).all()


@pytest.mark.parametrize("device", DEVICES)
def test_bfloat16_activations(device: str, seed: int) -> None:
    m, n, k = 17, 130, 200
    q, scale = (t.to(device) for t in quantize_fp8_blocks_ref(random_weight(n, k)))
    w = dequantize_fp8_blocks_ref(q, scale)
    x = torch.randn(m, k, device=device).to(torch.bfloat16)
    got = fp8_gemm(x, q, scale)
    assert got.dtype == torch.bfloat16
    assert ((got.float() - x.float() @ w.t()).abs() <= 2.0 ** -7 * (x.float().abs() @ w.abs().t()) + 1e-6).all()


def test_block_quantisation(seed: int) -> None:
    n, k = 200, 260  # partial edge blocks in both dimensions
    w = random_weight(n, k)
    w[128:, 128:256] = 0.0  # an all-zero block gets scale 1
    q, scale = quantize_fp8_blocks_ref(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (2, 3) and scale.dtype == torch.float32
    assert scale[1, 1] == 1.0
    blocks = torch.nn.functional.pad(w, (0, 384 - k, 0, 256 - n)).abs().view(2, 128, 3, 128).amax(dim=(1, 3))
    assert torch.allclose(scale[blocks > 0], blocks[blocks > 0] / FP8_MAX)
    assert q.float().abs().max() <= FP8_MAX  # every block's largest element lands at 448
    err = (dequantize_fp8_blocks_ref(q, scale) - w).abs()
    s = scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    # 3 mantissa bits: relative error 2**-4, or half a subnormal step (2**-10 * s) for tiny elements
    assert (err <= torch.maximum(2.0 ** -4 * w.abs(), 2.0 ** -10 * s)).all(), f"seed {seed}"


def test_launcher_checks_the_scale_grid() -> None:
    q, scale = quantize_fp8_blocks_ref(torch.randn(130, 72))
    with pytest.raises(ValueError, match="scale must be float32"):
        fp8_gemm(torch.randn(2, 72), q, scale[:1])
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_gemm(torch.randn(2, 72), q.float(), scale)
