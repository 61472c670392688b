"""Latent KV rows (MLA): the row format's numerics, and the Triton store against the torch reference.

The Triton store rounds to e4m3 and bfloat16 with integer arithmetic before casting
exactly representable values, so it must write the reference's bytes exactly, under
the interpreter (TRITON_INTERPRET=1, CPU tensors) as on CUDA.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: CPU runs interpret the kernels

import pytest
import torch

triton = pytest.importorskip("triton")
pytest.importorskip("numpy")  # the interpreter is numpy-backed

from backend.errors import InvalidRequest  # noqa: E402
from kernels.latent_kv_store import (FP8_GROUP, FP8_MAX, LATENT_FORMATS, dequantize_latent_ref,  # noqa: E402
                                     latent_row_bytes, latent_row_dtype, latent_row_elems, quantize_latent_ref,
                                     store_latent, store_latent_ref, store_latent_triton)

INTERPRET = triton.knobs.runtime.interpret
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="CPU runs need TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
        INTERPRET or not torch.cuda.is_available(), reason="needs a CUDA device and TRITON_INTERPRET=0")]),
]
ROPE_DIM = 16


@pytest.fixture
def seed() -> int:
    """Fresh inputs each run; the seed is in failure messages to replay one."""
    value = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(value)
    return value


def random_latent(num_tokens: int, kv_lora_rank: int) -> torch.Tensor:
    """randn with each (token, 32-value block) scaled by 2**U(-10, 10): group amaxes far from 1 and
    uneven inside a group, so small values of a group land in e4m3's subnormal range."""
    x = torch.randn(num_tokens, kv_lora_rank)
    blocks = torch.exp2(torch.empty(num_tokens, triton.cdiv(kv_lora_rank, 32)).uniform_(-10, 10))
    return x * blocks.repeat_interleave(32, dim=1)[:, :kv_lora_rank]


def edge_latent(kv_lora_rank: int) -> torch.Tensor:
    """[5, R] rows on the format's edges: an all-zero row, an exact-448 amax, float32 extremes,
    and values that round to ties and carry into the next e4m3 binade."""
    rows = random_latent(5, kv_lora_rank)
    rows[0] = 0.0  # every group's scale is 1.0
    rows[1, :FP8_GROUP] = 0.0  # the first group all zero
    rows[1, FP8_GROUP:] = torch.rand(max(kv_lora_rank - FP8_GROUP, 0)) * FP8_MAX
    rows[1, -1] = FP8_MAX  # (R > 128) the last group's amax is 448: scale exactly 1
    rows[2] *= 1e30
    rows[3] *= 1e-30
    rows[4] = torch.tensor([0.4989, -0.4989, 1.0625, -0.0, 15.5, 0.0, 9.0 / 512, -5.0 / 1024] * 64)[:kv_lora_rank]
    rows[4, -1] = FP8_MAX  # so the values above are stored unscaled
    return rows


def new_pages(num_pages: int, page_size: int, row_elems: int, kv_format: str, device: str) -> torch.Tensor:
    """Pages full of random bytes, so an untouched slot is recognisable."""
    if kv_format == "fp8_e4m3":
        return torch.randint(0, 256, (num_pages, page_size, row_elems), dtype=torch.uint8, device=device)
    return torch.randn(num_pages, page_size, row_elems).to(device, latent_row_dtype(kv_format))


def test_row_bytes_match_the_published_figures() -> None:
    # Kimi K2.x / DeepSeek-V3 / GLM-5: R = 512, Dr = 64
    assert latent_row_bytes(512, 64, "bf16") == 1152
    assert latent_row_bytes(512, 64, "fp32") == 2304
    assert latent_row_bytes(512, 64, "fp8_e4m3") == 512 + 16 + 128 == 656
    assert latent_row_bytes(136, 16, "fp8_e4m3") == 136 + 8 + 32  # two groups, the last partial
    assert latent_row_elems(512, 64, "fp8_e4m3") == 656 and latent_row_elems(512, 64, "fp32") == 576
    assert [latent_row_dtype(f) for f in LATENT_FORMATS] == [torch.float32, torch.bfloat16, torch.uint8]


def test_bad_dims_and_formats_are_invalid_requests() -> None:
    with pytest.raises(InvalidRequest, match="kv_lora_rank % 4"):
        latent_row_bytes(130, 64, "fp8_e4m3")
    with pytest.raises(InvalidRequest, match="kv_lora_rank % 4"):
        quantize_latent_ref(torch.randn(2, 30), torch.randn(2, 16), "fp8_e4m3")
    with pytest.raises(InvalidRequest, match="unknown latent KV format"):
        latent_row_dtype("int4")
    assert latent_row_bytes(130, 64, "bf16") == 388  # plain formats take any R
    pages = new_pages(2, 4, latent_row_elems(32, ROPE_DIM, "bf16"), "bf16", "cpu")
    with pytest.raises(InvalidRequest, match="pages must be"):
        store_latent(torch.randn(1, 32), torch.randn(1, ROPE_DIM), pages, torch.tensor([0]), "fp8_e4m3")
    with pytest.raises(InvalidRequest, match="slots"):
        store_latent(torch.randn(1, 32), torch.randn(1, ROPE_DIM), pages, torch.tensor([0], dtype=torch.int32), "bf16")


@pytest.mark.parametrize("kv_lora_rank", [32, 136, 512])
def test_fp8_round_trip_error_is_within_e4m3_precision(kv_lora_rank: int, seed: int) -> None:
    latent = torch.cat([random_latent(64, kv_lora_rank), edge_latent(kv_lora_rank)[:4]])
    k_pe = torch.randn(len(latent), ROPE_DIM)
    rows = quantize_latent_ref(latent, k_pe, "fp8_e4m3")
    assert rows.dtype == torch.uint8 and rows.shape == (len(latent), latent_row_elems(kv_lora_rank, ROPE_DIM,
                                                                                      "fp8_e4m3"))
    back, back_pe = dequantize_latent_ref(rows, kv_lora_rank, ROPE_DIM, "fp8_e4m3", torch.float32)
    num_groups = triton.cdiv(kv_lora_rank, FP8_GROUP)
    pad = num_groups * FP8_GROUP - kv_lora_rank
    err = torch.nn.functional.pad((back - latent).abs(), (0, pad)).unflatten(1, (num_groups, FP8_GROUP))
    amax = torch.nn.functional.pad(latent.abs(), (0, pad)).unflatten(1, (num_groups, FP8_GROUP)).amax(-1)
    # per group: the error is at most half an e4m3 step at the top binade, 2**-4 of the amax
    assert bool((err.amax(-1) <= amax * 2.0 ** -4).all()), f"seed {seed}"
    # and each normal value's relative error is <= 2**-4 (3 mantissa bits), mostly well inside that
    normal = (latent != 0) & (latent.abs() >= amax.repeat_interleave(FP8_GROUP, 1)[:, :kv_lora_rank] * 2.0 ** -14)
    rel = ((back - latent).abs() / latent.abs())[normal]
    assert float(rel.max()) <= 2.0 ** -4 and float(rel.mean()) < 2.0 ** -5, f"seed {seed}"
    # the scales sit where the layout says, amax / 448
    scales = rows[:, kv_lora_rank:kv_lora_rank + 4 * num_groups].contiguous().view(torch.float32)
    assert torch.equal(scales, torch.where(amax == 0, 1.0, amax / FP8_MAX)), f"seed {seed}"
    assert torch.equal(back_pe, k_pe.bfloat16().float()), f"seed {seed}"


def test_fp8_zero_group_has_scale_one_and_zero_values() -> None:
    latent = edge_latent(256)
    rows = quantize_latent_ref(latent, torch.randn(len(latent), ROPE_DIM), "fp8_e4m3")
    scales = rows[:, 256:264].contiguous().view(torch.float32)
    assert scales[0].tolist() == [1.0, 1.0] and scales[1].tolist() == [1.0, 1.0]  # all zero; amax exactly 448
    assert bool((rows[0, :256] == 0).all()) and bool((rows[1, :FP8_GROUP] == 0).all())
    back, _ = dequantize_latent_ref(rows, 256, ROPE_DIM, "fp8_e4m3", torch.float32)
    assert bool((back[0] == 0).all()) and not bool(back.isnan().any())


@pytest.mark.parametrize("kv_format", ["fp32", "bf16"])
def test_plain_round_trip_is_exact(kv_format: str, seed: int) -> None:
    dtype = latent_row_dtype(kv_format)
    latent, k_pe = random_latent(20, 40).to(dtype), torch.randn(20, ROPE_DIM).to(dtype)
    rows = quantize_latent_ref(latent, k_pe, kv_format)
    back, back_pe = dequantize_latent_ref(rows, 40, ROPE_DIM, kv_format, dtype)
    assert torch.equal(back, latent) and torch.equal(back_pe, k_pe), f"seed {seed}"
    # float32 input to bf16 rows rounds as torch's cast does (to nearest even)
    wide = random_latent(20, 40)
    assert torch.equal(quantize_latent_ref(wide, k_pe.float(), "bf16")[:, :40], wide.bfloat16()), f"seed {seed}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_format", LATENT_FORMATS)
@pytest.mark.parametrize("kv_lora_rank", [32, 136])
@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16])
def test_triton_store_writes_the_reference_bytes(device: str, kv_format: str, kv_lora_rank: int,
                                                 input_dtype: torch.dtype, seed: int) -> None:
    num_pages, page_size, num_tokens = 6, 8, 19
    latent = torch.cat([random_latent(num_tokens - 5, kv_lora_rank), edge_latent(kv_lora_rank)])
    k_pe = torch.randn(num_tokens, ROPE_DIM) * torch.exp2(torch.empty(num_tokens, 1).uniform_(-20, 20))
    latent, k_pe = latent.to(device, input_dtype), k_pe.to(device, input_dtype)
    slots = torch.randperm(num_pages * page_size)[:num_tokens].to(device)
    before = new_pages(num_pages, page_size, latent_row_elems(kv_lora_rank, ROPE_DIM, kv_format), kv_format, device)
    got, want = before.clone(), before.clone()

    store_latent_triton(latent, k_pe, got, slots, kv_format)
    store_latent_ref(latent, k_pe, want, slots, kv_format)

    assert torch.equal(got, want), f"seed {seed}: rows differ at {(got != want).nonzero()[:4].tolist()}"
    written = torch.zeros(num_pages * page_size, dtype=torch.bool, device=device)
    written[slots] = True
    written = written.view(num_pages, page_size)
    assert torch.equal(want[~written], before[~written]), f"seed {seed}: an untouched slot changed"
    assert not torch.equal(want[written], before[written])
    rows = want.view(-1, want.shape[-1])[slots]
    assert torch.equal(rows, quantize_latent_ref(latent, k_pe, kv_format)), f"seed {seed}"
    if kv_format != "fp32":  # the rope part is bfloat16, bit for bit
        rope = rows.view(torch.uint8)[:, -2 * ROPE_DIM:].contiguous().view(torch.bfloat16)
        assert torch.equal(rope, k_pe.bfloat16()), f"seed {seed}"


def test_store_latent_on_cpu_is_the_reference(seed: int) -> None:
    latent, k_pe = random_latent(7, 64), torch.randn(7, ROPE_DIM)
    slots = torch.randperm(24)[:7]
    got = new_pages(3, 8, latent_row_elems(64, ROPE_DIM, "fp8_e4m3"), "fp8_e4m3", "cpu")
    want = got.clone()
    store_latent(latent, k_pe, got, slots, "fp8_e4m3")
    store_latent_ref(latent, k_pe, want, slots, "fp8_e4m3")
    assert torch.equal(got, want), f"seed {seed}"
