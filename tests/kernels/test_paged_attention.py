"""Paged decode attention: the Triton kernel against its torch reference over FP8 and BF16 pages.

Every batch mixes context lengths 1, 15, 16, 17 and 130 (page size 16, 64-token
tiles: one token, a page minus one, exactly a page, a page plus one, several
tiles); pages are a random permutation, so sequences read pages out of order.
Slots no sequence owns hold NaN and page-table entries past a sequence's pages
point at random pages, so reading anything outside a context poisons the output.

Tolerances, elementwise, in units of mag = sum_t p_t |v_t| (the reference run on
|V|; it bounds |out| and is the scale summation errors grow with):
- float32 q, against the reference on the same (dequantised) cache: 1e-5 * mag.
  Both sides compute in float32; observed ~1e-6.
- bfloat16 q: 2**-6 * mag, two bf16 steps: the output is rounded to bf16 on both
  sides (the interpreter truncates), and the GPU dots take bf16 probabilities.
- FP8 pages against the reference on the original BF16 values: error / mag
  <= 0.025 on average over the batch's 3072 outputs and <= 0.4 everywhere.
  e4m3 keeps 3 mantissa bits (relative error <= 2**-4 per element) in V and in
  K, whose error moves the scores (|s| up to ~10 here). Over 60 seeds: mean
  0.015 (at most 0.017), worst element 0.09 typical, 0.21 at most.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: CPU runs interpret the kernels

from typing import NamedTuple

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("numpy")  # the interpreter is numpy-backed

from kernels.kv_store import store_kv, store_kv_ref  # noqa: E402
from kernels.paged_attention import (MAX_SPLITS, default_num_splits, paged_decode_attention,  # noqa: E402
                                     paged_decode_attention_ref)
from tests.kernels.test_kv_store import DEVICES, random_kv, seed  # noqa: E402,F401  (seed is a fixture)

PAGE_SIZE = 16
LENS = [1, 15, 16, 17, 130]
FP8 = torch.float8_e4m3fn
FORMATS = {"fp8_e4m3": FP8, "bf16": torch.bfloat16}


class Paged(NamedTuple):
    """One layer's cache plus the batch's page table, as the kernel takes them."""

    k_cache: torch.Tensor  # [num_pages, PAGE_SIZE, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    k_scale: torch.Tensor | None  # [num_pages, PAGE_SIZE, num_kv_heads] int8, FP8 only
    v_scale: torch.Tensor | None
    page_table: torch.Tensor  # [B, max_pages] int32
    context_lens: torch.Tensor  # [B] int32

    def with_abs_v(self) -> Paged:
        """The same cache with |V| (sign bit cleared), for the error scale sum_t p_t |v_t|."""
        if self.v_cache.dtype == FP8:
            return self._replace(v_cache=(self.v_cache.view(torch.uint8) & 0x7F).view(FP8))
        return self._replace(v_cache=self.v_cache.abs())


def random_layout(lens: list[int], spare_pages: int = 5) -> tuple[int, torch.Tensor]:
    """(num_pages, page_table [B, max_pages + 1] int32): pages randomly permuted,
    entries past a sequence's pages pointing at random pages."""
    pages_per_seq = [-(-n // PAGE_SIZE) for n in lens]
    num_pages = sum(pages_per_seq) + spare_pages
    page_table = torch.randint(num_pages, (len(lens), max(pages_per_seq) + 1), dtype=torch.int32)
    perm = torch.randperm(num_pages).int()
    start = 0
    for b, n in enumerate(pages_per_seq):
        page_table[b, :n] = perm[start:start + n]
        start += n
    return num_pages, page_table


def slots_of(page_table: torch.Tensor, b: int, n: int) -> torch.Tensor:
    positions = torch.arange(n)
    return page_table[b, positions // PAGE_SIZE].long() * PAGE_SIZE + positions % PAGE_SIZE


def build_paged(kv: list[tuple[torch.Tensor, torch.Tensor]], num_kv_heads: int, head_dim: int,
                dtype: torch.dtype, num_pages: int, page_table: torch.Tensor, device: str) -> Paged:
    """Store each sequence's K/V [n, kv_heads, head_dim] with the torch reference; other slots hold NaN."""
    shape = (num_pages, PAGE_SIZE, num_kv_heads, head_dim)
    k_cache, v_cache = (torch.full(shape, float("nan")).to(dtype) for _ in range(2))
    k_scale = v_scale = None
    if dtype == FP8:
        k_scale, v_scale = (torch.randint(-64, 64, shape[:3], dtype=torch.int8) for _ in range(2))
    for b, (k, v) in enumerate(kv):
        store_kv_ref(k, v, k_cache, v_cache, k_scale, v_scale, slots_of(page_table, b, k.shape[0]))
    context_lens = torch.tensor([k.shape[0] for k, _ in kv], dtype=torch.int32)
    move = (lambda t: None if t is None else t.to(device))
    return Paged(*map(move, (k_cache, v_cache, k_scale, v_scale, page_table, context_lens)))


def random_sequences(lens: list[int], num_kv_heads: int, head_dim: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """K scaled per (token, head) by 2**U(-4, 1) (scores stay O(10)), V by 2**U(-10, 10)."""
    out = []
    for n in lens:
        k = torch.randn(n, num_kv_heads, head_dim) * torch.exp2(torch.empty(n, num_kv_heads, 1).uniform_(-4, 1))
        out.append((k, random_kv(n, num_kv_heads, head_dim)))
    return out


def assert_close_in_mag(out: torch.Tensor, ref: torch.Tensor, mag: torch.Tensor, rtol: float, seed: int,
                        atol: float = 0.0) -> None:
    """|out - ref| <= rtol * mag + atol everywhere, `mag` the attention of |V| (the sum the rounding errors scale
    with). The tolerance is formed in float64: rtol * mag of an output in float32's subnormal range would itself
    underflow to 0 in float32. `atol` is for outputs down there, where float32 keeps an absolute precision only."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert bool(torch.isfinite(out).all()), f"seed {seed}: non-finite output (read outside a context?)"
    diff = (out.double() - ref.double()).abs()
    # where even the tolerance is 0 (a 1-token context whose value rounds to 0 in FP8) only equality passes
    ratio = torch.where(diff == 0, torch.zeros_like(diff), diff / (rtol * mag.double() + atol))
    assert float(ratio.max()) <= 1, f"seed {seed}: error {float(ratio.max()):.2f}x the tolerance at {ratio.argmax()}"


def run_case(device: str, fmt: str, group: int, num_splits: int | None, seed: int, head_dim: int = 64,
             q_dtype: torch.dtype = torch.float32, num_kv_heads: int = 2, **tuning: int) -> None:
    num_pages, page_table = random_layout(LENS)
    paged = build_paged(random_sequences(LENS, num_kv_heads, head_dim), num_kv_heads, head_dim, FORMATS[fmt],
                        num_pages, page_table, device)
    q = torch.randn(len(LENS), num_kv_heads * group, head_dim).to(device, q_dtype)
    scale = head_dim ** -0.5

    out = paged_decode_attention(q, *paged, scale, num_splits=num_splits, **tuning)
    ref = paged_decode_attention_ref(q, *paged, scale)
    mag = paged_decode_attention_ref(q.float(), *paged.with_abs_v(), scale)
    assert_close_in_mag(out, ref, mag, 1e-5 if q_dtype == torch.float32 else 2.0 ** -6, seed)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_matches_reference(device: str, fmt: str, group: int, num_splits: int, seed: int) -> None:
    run_case(device, fmt, group, num_splits, seed)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_n,warps", [(16, 2), (128, 8)])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_other_tile_widths(device: str, fmt: str, block_n: int, warps: int, seed: int) -> None:
    """The tile a benchmark sweeps: partitions cut on other tile boundaries, the same answer."""
    run_case(device, fmt, 3, 3, seed, block_n=block_n, num_warps=warps)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", [32, 48])
def test_other_head_dims_with_automatic_splits(device: str, head_dim: int, seed: int) -> None:
    run_case(device, "fp8_e4m3", 3, None, seed, head_dim=head_dim)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_bfloat16_queries(device: str, fmt: str, seed: int) -> None:
    run_case(device, fmt, 3, 2, seed, q_dtype=torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", [64, 48])
@pytest.mark.parametrize("group,num_splits", [(1, 1), (3, 3), (8, 2)])
def test_v_in_pairs_matches_reference(device: str, head_dim: int, group: int, num_splits: int, seed: int) -> None:
    """FP8 V read as int16 pairs and made float16 before its dot (`v_pairs`): the reference's answer, and on the
    interpreter the very bits of the plain float16 dots (the same float16 V values, the same dots)."""
    run_case(device, "fp8_e4m3", group, num_splits, seed, head_dim=head_dim, q_dtype=torch.bfloat16, v_pairs=True)
    if device == "cpu":  # on a GPU the two layouts may sum a dot's products in another order
        num_pages, page_table = random_layout(LENS)
        paged = build_paged(random_sequences(LENS, 2, head_dim), 2, head_dim, FP8, num_pages, page_table, device)
        q = torch.randn(len(LENS), 2 * group, head_dim).to(device, torch.bfloat16)
        pairs = paged_decode_attention(q, *paged, 0.125, num_splits=num_splits, v_pairs=True)
        assert torch.equal(pairs, paged_decode_attention(q, *paged, 0.125, num_splits=num_splits))


def test_v_pairs_refuses_what_it_cannot_read() -> None:
    num_pages, page_table = random_layout([3])
    paged = build_paged(random_sequences([3], 1, 16), 1, 16, FP8, num_pages, page_table, "cpu")
    with pytest.raises(ValueError, match="v_pairs"):  # float32 queries: no float16 dots
        paged_decode_attention(torch.randn(1, 1, 16), *paged, 0.25, v_pairs=True)
    with pytest.raises(ValueError, match="v_pairs"):
        paged_decode_attention(torch.randn(1, 1, 16).bfloat16(), *paged, 0.25, fp16_dots=False, v_pairs=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("v_log2", [-40, 24])
@pytest.mark.parametrize("fp16_dots,v_pairs", [(True, False), (False, False), (True, True)])
def test_fp8_values_far_outside_float16s_range(device: str, v_log2: int, fp16_dots: bool, v_pairs: bool,
                                               seed: int) -> None:
    """bfloat16 queries over FP8 pages whose V values sit near 2**-40 or 2**24 (per-token exponents far
    from 0, spread over 2**+-3): the float16 dots' probabilities and V stay in float16's range (module doc)."""
    num_pages, page_table = random_layout(LENS)
    kv = [(k, v * 2.0 ** v_log2) for k, v in random_sequences(LENS, 2, 64)]
    for _, v in kv:
        v *= torch.exp2(torch.randint(-3, 4, (v.shape[0], 1, 1)).float())
    paged = build_paged(kv, 2, 64, FP8, num_pages, page_table, device)
    q = torch.randn(len(LENS), 6, 64).to(device, torch.bfloat16)
    out = paged_decode_attention(q, *paged, 0.125, num_splits=2, fp16_dots=fp16_dots, v_pairs=v_pairs)
    ref = paged_decode_attention_ref(q, *paged, 0.125)
    mag = paged_decode_attention_ref(q.float(), *paged.with_abs_v(), 0.125)
    assert_close_in_mag(out, ref, mag, 2.0 ** -6, seed)


def test_fp16_dots_only_for_fp8_pages_with_bfloat16_queries() -> None:
    num_pages, page_table = random_layout([3])
    paged = build_paged(random_sequences([3], 1, 16), 1, 16, FP8, num_pages, page_table, "cpu")
    with pytest.raises(ValueError, match="fp16_dots"):
        paged_decode_attention(torch.randn(1, 1, 16), *paged, 0.25, fp16_dots=True)


@pytest.mark.parametrize("device", DEVICES)
def test_more_splits_than_tiles(device: str, seed: int) -> None:
    """Most partitions of the short sequences are empty; the merge must ignore them."""
    run_case(device, "bf16", 2, 7, seed, num_kv_heads=1)


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_is_close_to_the_unquantised_bf16_values(device: str, seed: int) -> None:
    num_kv_heads, group, head_dim = 2, 3, 64
    lens = LENS + [130, 130, 130]  # enough elements for a stable RMS
    kv = [(k.bfloat16(), v.bfloat16()) for k, v in random_sequences(lens, num_kv_heads, head_dim)]
    num_pages, page_table = random_layout(lens)
    fp8 = build_paged(kv, num_kv_heads, head_dim, FP8, num_pages, page_table, device)
    bf16 = build_paged(kv, num_kv_heads, head_dim, torch.bfloat16, num_pages, page_table, device)
    q = torch.randn(len(lens), num_kv_heads * group, head_dim, device=device)
    scale = head_dim ** -0.5

    out = paged_decode_attention(q, *fp8, scale, num_splits=2)
    ref = paged_decode_attention_ref(q, *bf16, scale)
    mag = paged_decode_attention_ref(q, *bf16.with_abs_v(), scale)
    rel = (out - ref).abs() / mag
    assert float(rel.mean()) <= 0.025, f"seed {seed}: mean error {float(rel.mean()):.4f} of mag"
    assert float(rel.max()) <= 0.4, f"seed {seed}: worst error {float(rel.max()):.3f} of mag"


@pytest.mark.parametrize("device", DEVICES)
def test_page_offsets_past_int32(device: str, seed: int) -> None:
    """Pages whose element offset page_id * stride_page is past 2**32: int32 index maths would wrap
    to a small offset, into pages 0.. that hold NaN. K and V interleave per page (stride 2 * PAGE_SIZE *
    head_dim = 512 elements), so 2**23 + 64 pages are 4 GiB of address space; torch.empty touches
    none of it, and only the ~10 pages written here (and the NaN pages) become resident."""
    num_kv_heads, head_dim, lens = 1, 16, [100, 37]
    num_pages = 2 ** 32 // (2 * PAGE_SIZE * num_kv_heads * head_dim) + 64
    pages = torch.empty(num_pages, 2, PAGE_SIZE, num_kv_heads, head_dim, dtype=torch.uint8, device=device)
    pages[:64] = 0x7F  # NaN in float8_e4m3fn: where wrapped offsets land
    k_cache, v_cache = pages.view(FP8)[:, 0], pages.view(FP8)[:, 1]
    scales = torch.empty(num_pages, 2, PAGE_SIZE, num_kv_heads, dtype=torch.int8, device=device)
    k_scale, v_scale = scales[:, 0], scales[:, 1]
    high = (num_pages - 1 - torch.randperm(40)[:10]).int()  # pages near the top, out of order
    pages[high.long().to(device)] = 0x7F  # NaN until written
    # sequence 0 on 7 pages, sequence 1 on 3; the entries past them point at the other's pages
    page_table = torch.stack([high[[0, 1, 2, 3, 4, 5, 6, 9]], high[[7, 8, 9, 0, 1, 2, 3, 4]]]).to(device)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    assert int(high.min()) * k_cache.stride(0) > 2 ** 32
    # K at moderate scales so scores stay O(10) (huge scores make float32 softmax sums ill-conditioned)
    for b, (k, v) in enumerate(random_sequences(lens, num_kv_heads, head_dim)):
        slots = slots_of(page_table.cpu(), b, k.shape[0]).to(device)
        store_kv(k.to(device), v.to(device), k_cache, v_cache, k_scale, v_scale, slots)
    q = torch.randn(len(lens), 4, head_dim, device=device)
    paged = Paged(k_cache, v_cache, k_scale, v_scale, page_table, context_lens)
    assert bool(torch.isfinite(paged_decode_attention_ref(q, *paged, 0.25)).all()), "store_kv wrote elsewhere"

    out = paged_decode_attention(q, *paged, 0.25, num_splits=2)
    ref = paged_decode_attention_ref(q, *paged, 0.25)
    pages[high.long().to(device), 1] &= 0x7F  # |V| in place (a copy would be 4 GiB)
    mag = paged_decode_attention_ref(q, *paged, 0.25)
    assert_close_in_mag(out, ref, mag, 1e-5, seed)


def test_default_num_splits() -> None:
    cpu = torch.device("cpu")
    assert default_num_splits(1, 3, 16, cpu) == 1  # one page: nothing to split
    assert default_num_splits(64, 8, 4096, cpu) == 1  # the batch alone fills the GPU
    assert 1 < default_num_splits(1, 3, 4096, cpu) <= 4096 // 256  # partitions of >= 256 tokens
    assert default_num_splits(1, 1, 10 ** 6, cpu) == MAX_SPLITS


def test_rejects_mismatched_arguments() -> None:
    num_pages, page_table = random_layout([20])
    paged = build_paged(random_sequences([20], 2, 32), 2, 32, FP8, num_pages, page_table, "cpu")
    q = torch.randn(1, 6, 32)
    with pytest.raises(ValueError, match="page_table"):
        paged_decode_attention(q, *paged._replace(page_table=paged.page_table.long()), 1.0)
    with pytest.raises(ValueError, match="context_lens"):
        paged_decode_attention(q, *paged._replace(context_lens=paged.context_lens.long()), 1.0)
    with pytest.raises(ValueError, match="kv heads"):
        paged_decode_attention(torch.randn(1, 5, 32), *paged, 1.0)
    with pytest.raises(ValueError, match="q must be"):
        paged_decode_attention(q.half(), *paged, 1.0)
