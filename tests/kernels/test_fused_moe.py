"""Fused MoE: the routing layout, the Triton kernels in every weight format against the torch
reference, and the reference against transformers' own Glm4Moe experts.

CPU runs interpret the kernels on tiny shapes; CUDA runs (marker `cuda`) use larger ones.
Shapes are odd where the format allows (H = 67, I = 37 for dense and FP8, whose edge
scale blocks are then partial; INT4 needs even K, so H = 66, I = 38 with partial groups
at g = 32 and 128); T = 1, 3, 17 with top-k 1, 2, 8. Experts are drawn from a random
subset of the E > T experts, so some get no token; those experts' weights (or scales)
are NaN, so a program that ran for them, or read them, would poison the output. Weights
are scaled per row by 2**U(-6, 6): FP8 block scales and INT4 group scales sit far from 1.

Tolerances, elementwise, in units of mag[t] = sum_j w_tj * (|x_t| @ |Wg|.T * |x_t| @ |Wu|.T)
@ |W2|.T (what the errors of the two GEMMs and the product scale with):
- float32 x: 1e-5 * mag (both sides float32; sums differ only in order).
- bfloat16 x: 3 * 2**-7 * mag. The reference rounds the intermediate and each slot's output
  to bf16 where the kernel stores them; the interpreter truncates those casts (1 ulp), and
  on a GPU the dequantised weights are rounded to bf16 before the dots (2**-9 each).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: CPU runs interpret the kernels

import pytest
import torch

triton = pytest.importorskip("triton")
pytest.importorskip("numpy")  # the interpreter is numpy-backed

from kernels.fp8_gemm import quantize_fp8_blocks_ref  # noqa: E402
from kernels.fused_moe import dequantize_experts_ref, fused_moe, fused_moe_ref, moe_align  # noqa: E402
from kernels.w4a16_gemm import quantize_int4_ref  # noqa: E402
from tests.kernels.test_kv_store import DEVICES, INTERPRET, seed  # noqa: E402,F401  (seed is a fixture)

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # sigmoid of large
CUDA = pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(),
                          reason="needs a CUDA device and TRITON_INTERPRET=0")
# (fmt, variant): fp8 scales in 128 x 128 blocks of the fused w13, or per row (gate and up quantised apart)
FORMATS = [("fp32", None), ("bf16", None), ("fp8", "blocks"), ("fp8", "rows"), ("int4", 32), ("int4", 128)]


def random_weights(e: int, n: int, k: int) -> torch.Tensor:
    """[e, n, k] randn, each row scaled by 2**U(-6, 6)."""
    return torch.randn(e, n, k) * torch.exp2(torch.empty(e, n, 1).uniform_(-6, 6))


def random_routing(t: int, k: int, e: int, hit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [t, k] (distinct per row, from a random subset of `hit` experts) and weights [t, k]."""
    allowed = torch.randperm(e)[:hit]
    ids = torch.stack([allowed[torch.randperm(hit)[:k]] for _ in range(t)])
    return ids, torch.rand(t, k) * 2 + 0.1


def quantise(fmt: str, variant: object, w: torch.Tensor, unused: torch.Tensor) -> dict[str, torch.Tensor]:
    """Stacked expert weights w [E, N, K] in `fmt`, with the `unused` experts' values poisoned (NaN)."""
    if fmt in ("fp32", "bf16"):
        w = w.to(torch.float32 if fmt == "fp32" else torch.bfloat16)
        w[unused] = float("nan")
        return {"w": w}
    if fmt == "fp8":
        if variant == "rows":  # halves quantised apart (as checkpoints store gate and up), scales expanded per row
            halves = w.chunk(2, dim=1) if w.shape[1] % 2 == 0 else (w,)
            parts = [[quantize_fp8_blocks_ref(m) for m in h] for h in halves]
            q = torch.cat([torch.stack([p[0] for p in part]) for part in parts], dim=1)
            s = torch.cat([torch.stack([p[1].repeat_interleave(128, 0)[:h.shape[1]] for p in part])
                           for part, h in zip(parts, halves)], dim=1)
        else:
            q, s = (torch.stack(t) for t in zip(*[quantize_fp8_blocks_ref(m) for m in w]))
        s[unused] = float("nan")
        return {"w": q, "scale": s.contiguous()}
    q, s, z = (torch.stack(t) for t in zip(*[quantize_int4_ref(m, variant) for m in w]))
    s[unused] = float("nan")
    return {"w": q, "scale": s, "zeros": z}


def moe_inputs(fmt: str, variant: object, t: int, k: int, e: int, h: int, i: int, dtype: torch.dtype,
               device: str) -> tuple[tuple, dict]:
    """(x, w13, w2, topk_weights, topk_ids), keyword arguments: a random problem, some experts unused."""
    ids, wts = random_routing(t, k, e, hit=max(k, (3 * e) // 4))
    unused = torch.ones(e, dtype=torch.bool)
    unused[ids.unique()] = False
    assert unused.any()  # some experts get no token
    w13 = quantise(fmt, variant, random_weights(e, 2 * i, h), unused)
    w2 = quantise(fmt, variant, random_weights(e, h, i), unused)
    x = (torch.randn(t, h) * 3).to(dtype)
    kwargs = {"fmt": fmt, "group_size": variant if fmt == "int4" else 128}
    for name, part in (("scale", "scale"), ("zeros", "zeros")):
        if part in w13:
            kwargs[f"w13_{name}"], kwargs[f"w2_{name}"] = w13[part].to(device), w2[part].to(device)
    return (x.to(device), w13["w"].to(device), w2["w"].to(device), wts.to(device), ids.to(device)), kwargs


def magnitude(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, wts: torch.Tensor, ids: torch.Tensor
              ) -> torch.Tensor:
    """mag [T, H] of the module docstring, in float64 from float32 weights (unused experts never read)."""
    i, k = w2.shape[2], ids.shape[1]
    flat, weights = ids.reshape(-1), wts.reshape(-1).double().abs()
    mag = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64, device=x.device)
    for expert in flat.unique().tolist():
        slots = (flat == expert).nonzero().squeeze(1)
        g_u = x[slots // k].double().abs() @ w13[expert].double().abs().t()  # [slots, 2I]
        act = g_u[:, :i] * g_u[:, i:]
        mag.index_add_(0, slots // k, weights[slots, None] * (act @ w2[expert].double().abs().t()))
    return mag.float()


def dequantised(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    x, w13, w2, _, _ = args
    fmt, g = kwargs["fmt"], kwargs["group_size"]
    return (dequantize_experts_ref(w13, fmt, kwargs.get("w13_scale"), kwargs.get("w13_zeros"), g, x.shape[1]),
            dequantize_experts_ref(w2, fmt, kwargs.get("w2_scale"), kwargs.get("w2_zeros"), g, w13.shape[1] // 2))


def check_against_reference(args: tuple, kwargs: dict, seed: int) -> None:
    x, _, _, wts, ids = args
    w13f, w2f = dequantised(args, kwargs)
    rtol = 1e-5 if x.dtype == torch.float32 else 3 * 2.0 ** -7
    tol = rtol * magnitude(x, w13f, w2f, wts, ids) + 1e-30
    expected = fused_moe_ref(*args, **kwargs)
    got = fused_moe(*args, **kwargs)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert torch.isfinite(got).all(), f"seed {seed}: an unused expert's weights were read"
    bad = (got.float() - expected.float()).abs() > tol
    assert not bad.any(), f"seed {seed}: {int(bad.sum())} of {bad.numel()} elements off"


def dims(fmt: str) -> tuple[int, int]:
    return (66, 38) if fmt == "int4" else (67, 37)  # (H, I): INT4 packs pairs along K


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt,variant", FORMATS)
@pytest.mark.parametrize("t,k", [(1, 8), (3, 2), (17, 1), (17, 8)])
def test_formats_match_the_reference(device: str, fmt: str, variant: object, t: int, k: int, seed: int) -> None:
    h, i = dims(fmt)
    dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
    args, kwargs = moe_inputs(fmt, variant, t, k, 20, h, i, dtype, device)
    check_against_reference(args, kwargs, seed)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt,variant", [("fp8", "rows"), ("int4", 32)])
def test_bfloat16_activations_on_quantised_experts(device: str, fmt: str, variant: object, seed: int) -> None:
    h, i = dims(fmt)
    args, kwargs = moe_inputs(fmt, variant, 17, 8, 9, h, i, torch.bfloat16, device)  # 8 experts hit, 17 slots each
    blocks = moe_align(args[4], 9, 16).block_expert
    assert (blocks[blocks >= 0].bincount() == 2).sum() == 8  # each expert hit spans 2 blocks
    check_against_reference(args, kwargs, seed)


@pytest.mark.parametrize("t,k", [(1, 2), (6, 3)])
def test_reference_is_transformers_glm4_moe_experts(t: int, k: int, seed: int) -> None:
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeExperts

    e, h, i = 7, 24, 10
    experts = Glm4MoeExperts(Glm4MoeConfig(hidden_size=h, moe_intermediate_size=i, n_routed_experts=e,
                                           num_experts_per_tok=k))
    w13, w2 = torch.randn(e, 2 * i, h), torch.randn(e, h, i)
    experts.gate_up_proj.data.copy_(w13)
    experts.down_proj.data.copy_(w2)
    ids, wts = random_routing(t, k, e, hit=e - 1)
    x = torch.randn(t, h)
    with torch.no_grad():
        expected = experts(x, ids, wts)
    assert (fused_moe_ref(x, w13, w2, wts, ids, fmt="fp32") - expected).abs().max() <= 1e-5 * expected.abs().max()
    if INTERPRET:
        assert (fused_moe(x, w13, w2, wts, ids, fmt="fp32") - expected).abs().max() <= 1e-5 * expected.abs().max()


@pytest.mark.parametrize("t,k,e,block_m", [(1, 8, 20, 16), (17, 2, 20, 16), (40, 4, 6, 16), (33, 3, 64, 32),
                                           (5, 1, 3, 4)])
def test_moe_align_layout(t: int, k: int, e: int, block_m: int, seed: int) -> None:
    ids, _ = random_routing(t, k, e, hit=max(k, e - 2))
    align = moe_align(ids.int(), e, block_m)
    flat = ids.reshape(-1)
    n = flat.numel()
    counts = torch.bincount(flat, minlength=e)
    padded = (counts + block_m - 1) // block_m * block_m
    num_padded = int(align.num_padded)
    assert align.num_padded.dtype == torch.int32 and num_padded == int(padded.sum())
    num_blocks = (n + min(e, n) * (block_m - 1)) // block_m  # the bound the grid is sized by
    assert align.sorted_ids.shape == (num_blocks * block_m,) and align.block_expert.shape == (num_blocks,)
    assert num_padded <= num_blocks * block_m
    used = align.sorted_ids[:num_padded].long()
    assert (align.sorted_ids[num_padded:] == n).all() and (align.block_expert[num_padded // block_m:] == -1).all()
    assert torch.equal(torch.sort(used[used < n]).values, torch.arange(n))  # every slot exactly once
    expected_blocks = torch.repeat_interleave(torch.arange(e), padded // block_m)  # experts in order, none unhit
    assert torch.equal(align.block_expert[:num_padded // block_m].long(), expected_blocks)
    for b, expert in enumerate(expected_blocks.tolist()):
        block = used[b * block_m:(b + 1) * block_m]
        real = block[block < n]
        assert (flat[real] == expert).all()
        assert (block[:len(real)] == real).all()  # padding only after an expert's slots
    for expert in range(e):  # an expert's slots in token order
        run = used[(used < n) & (flat[used.clamp(max=n - 1)] == expert)]
        assert torch.equal(run, (flat == expert).nonzero().squeeze(1))


def test_moe_align_small_example() -> None:
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]])  # slots 0..5; expert 1 gets none
    align = moe_align(ids, 4, 4)
    assert align.sorted_ids.tolist() == [1, 4, 6, 6, 0, 2, 5, 6, 3, 6, 6, 6] + [6] * 4
    assert align.block_expert.tolist() == [0, 2, 3, -1]
    assert align.num_padded.tolist() == [12]


def test_no_tokens_and_launcher_checks() -> None:
    args, kwargs = moe_inputs("int4", 32, 3, 2, 5, 66, 38, torch.float32, "cpu")
    x, w13, w2, wts, ids = args
    empty = fused_moe(x[:0], w13, w2, wts[:0], ids[:0], **kwargs)
    assert empty.shape == (0, 66)
    with pytest.raises(ValueError, match="fmt must be one of"):
        fused_moe(*args, **{**kwargs, "fmt": "int8"})
    with pytest.raises(ValueError, match="w13_zeros"):
        fused_moe(*args, **{**kwargs, "w13_zeros": None})
    with pytest.raises(ValueError, match="w2_scale must be float"):
        fused_moe(*args, **{**kwargs, "w2_scale": kwargs["w2_scale"][:, :, :1]})
    with pytest.raises(ValueError, match="K must be even"):
        fused_moe(torch.randn(3, 65), w13[:, :, :32], w2, wts, ids, **kwargs)
    with pytest.raises(ValueError, match="topk_weights"):
        fused_moe(x, w13, w2, wts[:, :1], ids, **kwargs)
    with pytest.raises(ValueError, match="w13 must be torch.float8_e4m3fn"):
        fused_moe(*args, fmt="fp8", w13_scale=kwargs["w13_scale"], w2_scale=kwargs["w2_scale"])
    with pytest.raises(ValueError, match="takes no scales"):
        fused_moe(x, torch.randn(5, 76, 66), torch.randn(5, 66, 38), wts, ids, fmt="fp32",
                  w13_scale=kwargs["w13_scale"])


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("fmt,variant", FORMATS)
@pytest.mark.parametrize("t", [1, 33, 300])
def test_cuda_larger_shapes(fmt: str, variant: object, t: int, seed: int) -> None:
    h, i = (1026, 704) if fmt == "int4" else (1000, 330)  # partial groups / scale blocks at the edges
    dtype = torch.float32 if fmt == "fp32" else torch.bfloat16
    args, kwargs = moe_inputs(fmt, variant, t, 8, 64, h, i, dtype, "cuda")
    check_against_reference(args, kwargs, seed)
