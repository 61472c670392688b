"""The CPU paged decode kernel (kernels/cpu/paged_decode.c) against the torch reference, on fresh
random inputs: every page format, GQA groups, shuffled pages, NaN in every slot it must not read."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from kernels.cpu_paged_attention import (amx_default, amx_tiles, available, build_error, dequantised_pages,
                                         fp8_as_bf16, pair_tiles, paged_decode_attention_cpu, tile_rows)
from kernels.kv_store import dequantize_fp8_table, quantize_fp8_ref
from kernels.paged_attention import paged_decode_attention_ref
from tests.kernels.test_kv_store import seed  # noqa: F401  (fixture)
from tests.kernels.test_paged_attention import (FP8, LENS, Paged, assert_close_in_mag, build_paged, random_layout,
                                                random_sequences)

pytestmark = pytest.mark.skipif(not available(), reason=f"CPU kernel not built: {build_error()}")
FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8_e4m3": FP8}


@contextmanager
def vector_copy() -> Iterator[None]:
    """The kernel's vector copy also where its AMX tiles would take the rows (the process's default after)."""
    amx_tiles(False)
    try:
        yield
    finally:
        amx_tiles(amx_default())


@pytest.fixture
def tiles_off() -> Iterator[None]:
    with vector_copy():
        yield


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_matches_reference(fmt: str, group: int, threads: int, seed: int) -> None:
    head_dim, num_kv_heads = 64, 2
    num_pages, page_table = random_layout(LENS)
    paged = build_paged(random_sequences(LENS, num_kv_heads, head_dim), num_kv_heads, head_dim, FORMATS[fmt],
                        num_pages, page_table, "cpu")
    q = torch.randn(len(LENS), num_kv_heads * group, head_dim)
    scale = head_dim ** -0.5
    out = paged_decode_attention_cpu(q, *paged, scale, threads=threads)
    ref = paged_decode_attention_ref(q, *paged, scale)
    mag = paged_decode_attention_ref(q, *paged.with_abs_v(), scale)
    assert out is not None
    assert_close_in_mag(out, ref, mag, 1e-5, seed)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("group,head_dim", [(3, 64), (6, 64), (8, 128), (20, 64)])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_decode_rows_with_kv_heads_read_together(fmt: str, group: int, head_dim: int, threads: int,
                                                 seed: int) -> None:
    """Enough sequences that a work item holds all of a row's KV heads, which decode rows read together on
    AVX2-only CPUs and on AVX-512F ones without BF16 (bf16 and fp8 pages), at most 16 query heads at a time (over
    fp8 pages the AVX2 copy's V loop takes up to 4 a pass): 3 KV heads of 3 or 6 query heads (one group; two
    groups of 2 and 1 KV heads), of 8 (groups of 2 and 1, head_dim 128), of 20 (more than a group holds: the
    per-head loop)."""
    lens = [1, 9, 33, 64, 100, 31, 17, 130, 2, 70]
    num_pages, page_table = random_layout(lens)
    paged = build_paged(random_sequences(lens, 3, head_dim), 3, head_dim, FORMATS[fmt], num_pages, page_table, "cpu")
    q = torch.randn(len(lens), 3 * group, head_dim)
    scale = head_dim ** -0.5
    out = paged_decode_attention_cpu(q, *paged, scale, threads=threads)
    assert out is not None
    assert_close_in_mag(out, paged_decode_attention_ref(q, *paged, scale),
                        paged_decode_attention_ref(q, *paged.with_abs_v(), scale), 1e-5, seed)


def _fp8_paged_at_the_ends(lens: list[int], k_log2: int, v_log2: int):
    """fp8 pages of K near 2^k_log2 and V near 2^v_log2, a subnormal code beside each row's largest."""
    kv = []
    for k, v in random_sequences(lens, 3, 64):
        for x in (k, v):  # 2^-16 of the row's largest: an e = 0 code (e4m3's smallest normal is 2^-6, 448 = 2^8.8)
            x[:, :, 1] = x.abs().amax(-1) * 2.0 ** -16
        kv.append((k * 2.0 ** k_log2, v * 2.0 ** v_log2))
    num_pages, page_table = random_layout(lens)
    paged = build_paged(kv, 3, 64, FP8, num_pages, page_table, "cpu")
    for pages in (paged.k_cache, paged.v_cache):
        codes = pages.view(torch.uint8)
        assert bool(((codes & 0x78 == 0) & (codes & 0x07 != 0)).any())  # subnormal codes among them
    return paged


def fp8_subnormal_floor(context_lens: torch.Tensor) -> float:
    """The absolute error float32 allows the kernel at outputs in its subnormal range (`assert_close_in_mag`'s
    `atol`). The kernel multiplies a token's 2^e into its softmax weight (V near 2^-60: e ~ -69); with weights
    down to e^-60 that product falls below float32's normal range (2^-126), where it keeps an absolute precision
    of 2^-150 (half the smallest subnormal), which the widened code (|code| <= 448 < 2^9) multiplies: up to 2^-141
    per key. Only outputs that small feel it: the subnormal column's (V at 2^-16 of a row's largest) when its
    heaviest keys hold code 0 there. The reference's products p * v round on the same grid, 2^-150 per key."""
    return (int(context_lens.max()) + 1) * 2.0 ** -141


@pytest.mark.parametrize("k_log2,v_log2", [(-60, 55), (55, -60)])
@pytest.mark.parametrize("group", [3, 6])
def test_fp8_decode_rows_at_the_ends_of_the_exponent_range(k_log2: int, v_log2: int, group: int, seed: int) -> None:
    """Decode rows over fp8 pages whose tokens' exponents lie near both ends of theirs (-64 .. 63; K near 2^55 and
    2^-60, the queries scaled back so the scores stay O(10); V near 2^-60 and 2^55), subnormal codes beside each
    row's largest: the vector copies apply 2^e, and the AVX2 and AVX-512F decode rows the 2^-8 of their float16
    conversion, as exact scalings."""
    lens = [1, 40, 130, 17, 64, 9, 33, 100]
    paged = _fp8_paged_at_the_ends(lens, k_log2, v_log2)
    q = torch.randn(len(lens), 3 * group, 64) * 2.0 ** -k_log2
    out = paged_decode_attention_cpu(q, *paged, 0.125, threads=2)
    assert out is not None
    ref = paged_decode_attention_ref(q, *paged, 0.125)
    assert_close_in_mag(out, ref, paged_decode_attention_ref(q, *paged.with_abs_v(), 0.125), 1e-5, seed,
                        fp8_subnormal_floor(paged.context_lens))
    assert 2.0 ** (v_log2 - 20) < float(ref.abs().max()) < 2.0 ** (v_log2 + 20)


@pytest.mark.parametrize("k_log2,v_log2", [(-60, 55), (55, -60)])
def test_fp8_prompt_tiles_at_the_ends_of_the_exponent_range(k_log2: int, v_log2: int, seed: int) -> None:
    """The same pages under a prompt chunk's tiles, whose vector copies widen K and V rows to float32 by float16
    (subnormal codes as their exact values), with scores tens apart, so that weights at the kernel's floor (e^-60)
    meet the tokens' 2^e. Scores of tens carry float32 rounding into every weight, in both implementations, hence
    `test_scores_spread_far_apart`'s wider tolerance."""
    lens = [130, 40, 17]
    paged = _fp8_paged_at_the_ends(lens, k_log2, v_log2)
    table, keys = _prompt_rows(paged, lens, (30, 130))
    rows = paged._replace(page_table=table, context_lens=keys)
    q = torch.randn(len(keys), 9, 64) * 2.0 ** -k_log2 * 8  # scores of tens: weights down to e^-100 and below
    tiles = torch.tensor([0, 1, *range(2, len(keys), tile_rows(3)), len(keys)], dtype=torch.int32)
    out = paged_decode_attention_cpu(q, *rows, 0.125, threads=2, tiles=tiles)
    assert out is not None
    ref = paged_decode_attention_ref(q, *rows, 0.125)
    assert_close_in_mag(out, ref, paged_decode_attention_ref(q, *rows.with_abs_v(), 0.125), 2e-4, seed,
                        fp8_subnormal_floor(keys))


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("head_dim", [32, 128, 96])
def test_other_head_dims(head_dim: int, fmt: str, seed: int) -> None:
    """128 runs the kernel's copy specialised for it (64 is the test above); 32 and 96 the generic one."""
    num_pages, page_table = random_layout([3, 40, 77])
    paged = build_paged(random_sequences([3, 40, 77], 1, head_dim), 1, head_dim, FORMATS[fmt], num_pages, page_table,
                        "cpu")
    q = torch.randn(3, 5, head_dim)
    out = paged_decode_attention_cpu(q, *paged, 0.1)
    assert_close_in_mag(out, paged_decode_attention_ref(q, *paged, 0.1),
                        paged_decode_attention_ref(q, *paged.with_abs_v(), 0.1), 1e-5, seed)


@pytest.mark.parametrize("spread,rtol", [(3.0, 1e-5), (40.0, 2e-4)])
def test_scores_spread_far_apart(spread: float, rtol: float, seed: int) -> None:
    """Softmax weights from e^0 down to far below float32's range: the kernel's polynomial exponential
    (and its zero below e^-60) against the reference's, with scores apart by tens to thousands. At the
    wide spread the scores themselves (tens to hundreds) carry float32 rounding of ~|score| * 2^-24 into
    every weight, in both implementations (up to 5e-5 over 300 seeds; over 40 seeds `expf` and the
    polynomial had the same worst case, 3.1e-5), so its tolerance is wider; an exponential that were off
    would still be off by far more."""
    lens = [1, 17, 90, 300]
    num_pages, page_table = random_layout(lens)
    paged = build_paged(random_sequences(lens, 2, 64), 2, 64, torch.float32, num_pages, page_table, "cpu")
    q = torch.randn(len(lens), 6, 64) * spread
    out = paged_decode_attention_cpu(q, *paged, 0.125)
    assert_close_in_mag(out, paged_decode_attention_ref(q, *paged, 0.125),
                        paged_decode_attention_ref(q, *paged.with_abs_v(), 0.125), rtol, seed)


@pytest.mark.parametrize("head_dim", [64, 96])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_bfloat16_queries_give_the_float32_result_rounded(fmt: str, head_dim: int, tiles_off: None) -> None:
    """bf16 q in, bf16 out: exactly the float32 call on the widened q, rounded to nearest even as torch
    rounds (the AVX-512 copy at 64, the generic one at 96), with ties and a NaN query row included, over
    every page format (no copy scores bf16 q another way since the `vdpbf16ps` copies went, 2026-12-07)."""
    lens = [3, 40, 77]
    num_pages, page_table = random_layout(lens)
    paged = build_paged(random_sequences(lens, 2, head_dim), 2, head_dim, FORMATS[fmt], num_pages, page_table,
                        "cpu")
    q = torch.randn(3, 6, head_dim).bfloat16()
    q[1, 2] = float("nan")
    for threads in (1, 2):
        wide = paged_decode_attention_cpu(q.float(), *paged, 0.125, threads=threads)
        half = paged_decode_attention_cpu(q, *paged, 0.125, threads=threads)
        assert half.dtype == torch.bfloat16 and wide.dtype == torch.float32
        finite = ~wide.isnan()
        assert torch.equal(half[finite].view(torch.int16), wide[finite].bfloat16().view(torch.int16))
        assert torch.equal(half.isnan(), wide.isnan()) and wide[1, 2].isnan().all() and not wide[0].isnan().any()


@pytest.mark.parametrize("head_dim", [64, 96])
def test_bfloat16_output_rounds_ties_to_even(head_dim: int) -> None:
    """Zero queries weigh a context of 16 or 32 equal V rows alike, so the float32 result is that row
    exactly; its values lie halfway between two bfloat16 numbers, and the output must round them to even."""
    lens = [16, 32]
    bf16_bits = torch.randn(1, 1, head_dim).bfloat16().view(torch.int16).to(torch.int32)
    v_row = ((bf16_bits << 16) | 0x8000).view(torch.float32)  # each halfway to the next bfloat16 number
    kv = [(torch.randn(n, 1, head_dim), v_row.expand(n, 1, head_dim).clone()) for n in lens]
    num_pages, page_table = random_layout(lens)
    paged = build_paged(kv, 1, head_dim, torch.float32, num_pages, page_table, "cpu")
    out = paged_decode_attention_cpu(torch.zeros(2, 2, head_dim, dtype=torch.bfloat16), *paged, 0.125)
    assert torch.equal(out.view(torch.int16), v_row.bfloat16().expand(2, 2, head_dim).view(torch.int16))


def test_declines_what_it_cannot_run() -> None:
    """Shapes beyond its buffers or another page dtype: None, so the caller takes the torch path."""
    num_pages, page_table = random_layout([5])
    paged = build_paged(random_sequences([5], 1, 320), 1, 320, torch.float32, num_pages, page_table, "cpu")
    assert paged_decode_attention_cpu(torch.randn(1, 1, 320), *paged, 1.0) is None
    f16 = paged._replace(k_cache=paged.k_cache.half(), v_cache=paged.v_cache.half())
    assert paged_decode_attention_cpu(torch.randn(1, 1, 320), *f16, 1.0) is None


def _prompt_rows(paged, lens: list[int], chunk: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows as a mixed step lays them out: a decode row per sequence but the first, whose rows `chunk`
    (positions start .. end-1) are a prompt chunk; returns every row's page table and key count."""
    start, end = chunk
    tables = [paged.page_table[i:i + 1] for i in range(1, len(lens))] + [paged.page_table[:1].expand(end - start, -1)]
    keys = [torch.tensor(lens[1:], dtype=torch.int32), torch.arange(start + 1, end + 1, dtype=torch.int32)]
    return torch.cat(tables), torch.cat(keys)


def _prompt_chunk(fmt: str, head_dim: int, per_tile: int, start: int = 17) -> tuple[Paged, torch.Tensor]:
    """Pages of 3 sequences (83, 40, 5 keys) over 2 KV heads in `fmt`, laid out as a mixed step: a decode row each
    for the last two, then the first one's rows start..82 as a prompt chunk in tiles of `per_tile` rows (the last
    shorter); returns the rows (page tables and key counts) and the tiles."""
    lens = [83, 40, 5]
    num_pages, page_table = random_layout(lens)
    paged = build_paged(random_sequences(lens, 2, head_dim), 2, head_dim, FORMATS[fmt], num_pages, page_table,
                        "cpu")
    table, keys = _prompt_rows(paged, lens, (start, 83))
    decode = len(lens) - 1
    tiles = torch.tensor([*range(decode), *range(decode, len(keys), per_tile), len(keys)], dtype=torch.int32)
    return paged._replace(page_table=table, context_lens=keys), tiles


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("group,head_dim,per_tile", [(3, 64, 10), (1, 64, 32), (3, 64, 7), (2, 128, 16),
                                                      (1, 64, 7), (1, 64, 11), (3, 96, 8)])
def test_prompt_tiles_match_the_rows_one_by_one(fmt: str, group: int, head_dim: int, per_tile: int,
                                                seed: int) -> None:
    """A prompt chunk's rows in tiles (each block of keys against all of a tile's query heads, the causal
    diagonal masked per query) give what each row alone gives, and the reference: tiles that end inside a
    block and across one, a last tile shorter than the rest, decode rows alone in between. 96 runs the
    generic code, which takes a tile row by row. A row alone is a decode row, which on an AVX2-only CPU runs
    another loop (`attend_dec8`: the same arithmetic summed in another order), so the two agree within the
    reference's tolerance of the output's magnitude, not bit for bit."""
    rows, tiles = _prompt_chunk(fmt, head_dim, per_tile)
    q = torch.randn(rows.context_lens.numel(), 2 * group, head_dim)
    for threads in (1, 2):
        tiled = paged_decode_attention_cpu(q, *rows, 0.125, threads=threads, tiles=tiles)
        alone = paged_decode_attention_cpu(q, *rows, 0.125, threads=threads)
        assert tiled is not None and alone is not None
        mag = paged_decode_attention_ref(q, *rows.with_abs_v(), 0.125)
        assert_close_in_mag(tiled, alone, mag, 1e-5, seed)
        assert_close_in_mag(tiled, paged_decode_attention_ref(q, *rows, 0.125), mag, 1e-5, seed)


@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("head_dim,per_tile", [(64, 10), (128, 8)])
def test_bfloat16_prompt_tiles_give_the_float32_result_rounded(fmt: str, head_dim: int, per_tile: int, seed: int,
                                                                tiles_off: None) -> None:
    """The engine's bfloat16 prefill: bf16 q in prompt tiles over bf16 or fp8 pages (on AVX-512F CPUs without
    AVX512-BF16 the tiles' copy that widens K and V; AMX tiles off, as they round the weights), against the
    float32 call on the widened q: that call's result rounded, and the reference within the usual tolerance."""
    if pair_tiles():
        pytest.skip("bf16 prompt tiles score by vdpbf16ps here, weights rounded: the test below")
    rows, tiles = _prompt_chunk(fmt, head_dim, per_tile)
    q = torch.randn(rows.context_lens.numel(), 6, head_dim).bfloat16()
    for threads in (1, 2):
        half = paged_decode_attention_cpu(q, *rows, 0.125, threads=threads, tiles=tiles)
        wide = paged_decode_attention_cpu(q.float(), *rows, 0.125, threads=threads, tiles=tiles)
        assert half is not None and wide is not None and half.dtype == torch.bfloat16
        assert torch.equal(half.view(torch.int16), wide.bfloat16().view(torch.int16))
        mag = paged_decode_attention_ref(q.float(), *rows.with_abs_v(), 0.125)
        assert_close_in_mag(wide, paged_decode_attention_ref(q.float(), *rows, 0.125), mag, 1e-5, seed)


@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("group,head_dim,per_tile,start", [(3, 64, 10, 17), (1, 64, 32, 17), (2, 128, 7, 17),
                                                            (4, 64, 3, 17), (3, 64, 9, 17), (3, 64, 10, 0),
                                                            (12, 128, 2, 17)])
def test_bfloat16_prompt_tiles_by_dot_products_match_the_reference(fmt: str, group: int, head_dim: int,
                                                                   per_tile: int, start: int, seed: int,
                                                                   tiles_off: None) -> None:
    """bf16 q in prompt tiles over bf16 or fp8 pages on AVX512-BF16 CPUs (`attend_pairs16`: both products by
    `vdpbf16ps`, two keys a word for P . V, the weights rounded to bfloat16 as on the AMX tiles): within 3
    bfloat16 rounding units of the output's magnitude against the reference (~1.6 measured; the widened copy's
    rounded result is within 1), the same bits on 1 and 2 threads, and not the widened call's rounded result (the
    tiles ran on this copy). Blocks of an odd key count (the chunk's rows end anywhere), 1 or 2 head vectors, a
    prompt from its first token (rows that see 1, 2, ... keys), GLM-4.5's 12 query heads a KV head at 128 dims."""
    if not pair_tiles():
        pytest.skip("no AVX512-BF16 copy here: bf16 prompt tiles are widened to float32 (the test above)")
    rows, tiles = _prompt_chunk(fmt, head_dim, per_tile, start)
    q = torch.randn(rows.context_lens.numel(), 2 * group, head_dim).bfloat16()
    one = paged_decode_attention_cpu(q, *rows, 0.125, threads=1, tiles=tiles)
    two = paged_decode_attention_cpu(q, *rows, 0.125, threads=2, tiles=tiles)
    wide = paged_decode_attention_cpu(q.float(), *rows, 0.125, threads=2, tiles=tiles)
    assert one is not None and two is not None and wide is not None and one.dtype == torch.bfloat16
    assert torch.equal(one.view(torch.int16), two.view(torch.int16))
    ref = paged_decode_attention_ref(q.float(), *rows, 0.125)
    mag = paged_decode_attention_ref(q.float(), *rows.with_abs_v(), 0.125)
    assert_close_in_mag(one.float(), ref, mag, 3 * 2.0 ** -8, seed)
    prompt = slice(2, None)  # rows 0 and 1 are decode rows, which widen
    assert not torch.equal(one[prompt].view(torch.int16), wide[prompt].bfloat16().view(torch.int16))
    assert torch.equal(one[:2].view(torch.int16), wide[:2].bfloat16().view(torch.int16))


def test_prompt_tiles_it_cannot_take_are_declined() -> None:
    """Tiles of more query heads than the kernel holds, rows whose key counts fall, or first rows that do not
    cover the rows: None (the caller runs the rows without tiles), never a wrong answer."""
    lens = [60]
    num_pages, page_table = random_layout(lens)
    paged = build_paged(random_sequences(lens, 1, 64), 1, 64, torch.float32, num_pages, page_table, "cpu")
    table, keys = _prompt_rows(paged, lens, (20, 60))
    rows = paged._replace(page_table=table, context_lens=keys)
    q = torch.randn(40, 4, 64)
    good = torch.tensor([0, 8, 16, 24, 32, 40])
    assert paged_decode_attention_cpu(q, *rows, 0.1, tiles=good) is not None
    assert paged_decode_attention_cpu(q, *rows, 0.1, tiles=torch.tensor([0, 9, 16, 24, 32, 40])) is None  # 9 x 4 > 32
    assert paged_decode_attention_cpu(q, *rows, 0.1, tiles=torch.tensor([0, 8, 16, 24, 32, 39])) is None
    assert paged_decode_attention_cpu(q, *rows, 0.1, tiles=torch.tensor([1, 8, 16, 24, 32, 40])) is None
    assert paged_decode_attention_cpu(q, *rows, 0.1, tiles=torch.tensor([0, 16, 8, 24, 32, 40])) is None
    falling = rows._replace(context_lens=keys.flip(0).contiguous())
    assert paged_decode_attention_cpu(q, *falling, 0.1, tiles=good) is None


@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("tiled", [False, True])
def test_bfloat16_scores_by_dot_product_match_the_reference(fmt: str, head_dim: int, tiled: bool, seed: int,
                                                            tiles_off: None) -> None:
    """bf16 queries against bf16 or fp8 pages (the served bf16 model's case): decode rows and a prompt chunk in
    tiles against the reference on the same page values, within the output's bfloat16 rounding, or 3 of them for
    tiles that score by `vdpbf16ps` (their weights rounded). (Decode rows on the AMX tiles: the test below.)"""
    lens = [150, 33, 7]
    num_pages, page_table = random_layout(lens)
    paged = build_paged(random_sequences(lens, 2, head_dim), 2, head_dim, FORMATS[fmt], num_pages, page_table,
                        "cpu")
    table, keys = _prompt_rows(paged, lens, (90, 150))
    rows = paged._replace(page_table=table, context_lens=keys)
    q = torch.randn(len(keys), 6, head_dim).bfloat16()
    tiles = torch.tensor([0, 1, *range(2, len(keys), 10), len(keys)], dtype=torch.int32) if tiled else None
    out = paged_decode_attention_cpu(q, *rows, 0.125, threads=2, tiles=tiles)
    assert out is not None and out.dtype == torch.bfloat16
    ref = paged_decode_attention_ref(q.float(), *rows, 0.125)
    mag = paged_decode_attention_ref(q.float(), *rows.with_abs_v(), 0.125)
    assert_close_in_mag(out.float(), ref, mag, (3 if tiled and pair_tiles() else 1) * 2.0 ** -8, seed)


@pytest.mark.parametrize("by_table", [False, True], ids=["bits", "table"])
def test_fp8_keys_become_their_exact_bfloat16_values(by_table: bool) -> None:
    """Every fp8_e4m3 code but the two NaNs (which the store writes only for NaN inputs) as the kernel scores it:
    the exact value, as torch converts it, subnormals (e = 0, which a bit placement alone would make bfloat16
    subnormals that `vdpbf16ps` reads as zero) and both zeros included; by bits (the vector copy) and by table
    (the AMX tiles and `dequantised_pages`, which also turn the NaN codes into NaN, as torch does)."""
    codes = torch.randperm(256).to(torch.uint8)  # every code, in an order of its own each run
    got = fp8_as_bf16(codes, by_table=by_table)
    if got is None:
        pytest.skip("no AVX512-BF16 copy here: fp8 keys are widened to float32 (the tests above)" if not by_table
                    else "no AVX512-VBMI here: the tiles convert by bits")
    want = codes.view(FP8).to(torch.bfloat16)
    finite = ~want.isnan()
    assert int(finite.sum()) == 254
    assert torch.equal(got[finite].view(torch.int16), want[finite].view(torch.int16))
    if by_table:
        assert bool(got[~finite].isnan().all())


@pytest.mark.parametrize("head_dim,group", [(64, 3), (64, 1), (64, 16), (128, 8)])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3"])
def test_decode_rows_on_amx_tiles_match_the_reference(fmt: str, head_dim: int, group: int, threads: int,
                                                      seed: int) -> None:
    """Decode rows on the AMX tiles where the CPU has them (fp8 pages: every row; bf16: rows of at least 128
    keys, shorter ones on the vector copy): key counts that end inside a block of 16, on a 32-key boundary,
    and across several 128-key softmax steps, the pool's unused rows NaN; within 3 bfloat16 rounding units of
    the output's magnitude (the weights rounded to bfloat16: the kernel's bound; ~1.5 seen), as the vector
    copy is on the same rows within one; a NaN query head NaN on both, only there."""
    if not amx_tiles(True):
        pytest.skip("no AMX tiles here (the CPU, the build, or the kernel's tile state)")
    lens = [128, 129, 160, 300, 1000, 40]
    num_pages, page_table = random_layout(lens)
    paged = build_paged(random_sequences(lens, 2, head_dim), 2, head_dim, FORMATS[fmt], num_pages, page_table,
                        "cpu")
    q = torch.randn(len(lens), 2 * group, head_dim).bfloat16()
    q[2, 1] = float("nan")
    tiled = paged_decode_attention_cpu(q, *paged, 0.125, threads=threads)
    with vector_copy():
        vector = paged_decode_attention_cpu(q, *paged, 0.125, threads=threads)
    ref = paged_decode_attention_ref(q.float(), *paged, 0.125)
    mag = paged_decode_attention_ref(q.float(), *paged.with_abs_v(), 0.125)
    nan = torch.zeros_like(ref, dtype=torch.bool)
    nan[2, 1] = True  # the NaN query head's output: NaN on both copies, every other head's finite
    assert torch.equal(tiled.isnan(), nan) and torch.equal(vector.isnan(), nan)
    finite = ~nan
    ratio = (tiled.float() - ref).abs()[finite] / mag[finite]
    assert float(ratio.max()) <= 3 * 2.0 ** -8, f"seed {seed}: {float(ratio.max()) / 2.0 ** -8:.2f} units"
    assert float(((vector.float() - ref).abs()[finite] / mag[finite]).max()) <= 2.0 ** -8
    assert not torch.equal(tiled[:5], vector[:5])  # the long rows ran another computation (its rounded weights)
    assert torch.equal(tiled[5], vector[5]) == (fmt == "bf16")  # 40 keys: the tiles over fp8 pages only


@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3"])
def test_decode_rows_give_the_same_bits_beside_prompt_tiles(fmt: str) -> None:
    """A decode row (a tile of one row) takes the same path alone and in a call with a prompt chunk's tiles, as a
    unified worker's mixed step and the fused decode layers' two calls for it need (the AMX tiles where the CPU
    has them)."""
    lens = [300, 140, 20, 200]
    num_pages, page_table = random_layout(lens)
    paged = build_paged(random_sequences(lens, 2, 64), 2, 64, FORMATS[fmt], num_pages, page_table, "cpu")
    table, keys = _prompt_rows(paged, lens, (150, 170))  # decode rows 140, 20, 200, then 20 prompt rows
    rows = paged._replace(page_table=table, context_lens=keys)
    q = torch.randn(len(keys), 6, 64).bfloat16()
    mixed = paged_decode_attention_cpu(q, *rows, 0.125, threads=2, tiles=torch.tensor([0, 1, 2, 3, 13, 23]))
    alone = paged_decode_attention_cpu(q[:3], *rows._replace(page_table=table[:3], context_lens=keys[:3]), 0.125,
                                       threads=2)
    assert mixed is not None and alone is not None
    assert torch.equal(mixed[:3], alone)


@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("head_dim,group,per_tile", [(64, 3, 10), (64, 1, 32), (128, 2, 7), (64, 4, 3)])
def test_prompt_tiles_on_amx_tiles_match_the_reference(fmt: str, head_dim: int, group: int, per_tile: int,
                                                       seed: int) -> None:
    """A prompt chunk's tiles on the AMX tiles (in groups of at most 16 query heads, where the CPU has them): each
    row sees the keys up to its own position (the causal diagonal inside a 16-key block and across 128-key
    steps), within the kernel's bound of the reference, as decode rows are."""
    if not amx_tiles(True):
        pytest.skip("no AMX tiles here (the CPU, the build, or the kernel's tile state)")
    lens = [400, 33, 7]
    num_pages, page_table = random_layout(lens)
    paged = build_paged(random_sequences(lens, 2, head_dim), 2, head_dim, FORMATS[fmt], num_pages, page_table,
                        "cpu")
    table, keys = _prompt_rows(paged, lens, (100, 400))  # decode rows 33 and 7, then 300 prompt rows
    rows = paged._replace(page_table=table, context_lens=keys)
    q = torch.randn(len(keys), 2 * group, head_dim).bfloat16()
    tiles = torch.tensor([0, 1, *range(2, len(keys), per_tile), len(keys)], dtype=torch.int32)
    tiled = paged_decode_attention_cpu(q, *rows, 0.125, threads=2, tiles=tiles)
    with vector_copy():
        vector = paged_decode_attention_cpu(q, *rows, 0.125, threads=2, tiles=tiles)
    assert tiled is not None and vector is not None
    ref = paged_decode_attention_ref(q.float(), *rows, 0.125)
    mag = paged_decode_attention_ref(q.float(), *rows.with_abs_v(), 0.125)
    assert_close_in_mag(tiled.float(), ref, mag, 3 * 2.0 ** -8, seed)
    assert not torch.equal(tiled[2:], vector[2:])  # the prompt rows ran on the tiles


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantised_pages_equal_the_torch_dequantiser(dtype: torch.dtype) -> None:
    """Pages picked out of an fp8 pool (out of order, one twice) as their true values, code x 2^e, bit for bit
    as `dequantize_fp8_table` gives them: tokens whose magnitudes span 1e-30 .. 1e30 (exponents near both ends
    of int8's range), subnormal codes and zeros included."""
    pages, size, heads, head_dim = 24, 16, 2, 64
    x = torch.randn(pages, size, heads, head_dim) * torch.logspace(-30, 30, pages * size).view(pages, size, 1, 1)
    x[0, 0, 0, :8] = 0.0
    x[1, 0, 0, 1] = x[1, 0, 0, 0] * 2.0 ** -12  # e = 0 codes beside the row's largest value
    codes, exps = quantize_fp8_ref(x)
    codes, exps = codes.view(pages, size, heads, head_dim), exps.view(pages, size, heads)
    ids = torch.cat([torch.randperm(pages)[:10], torch.tensor([3])])
    got = dequantised_pages(codes, exps, ids, dtype)
    if got is None:
        pytest.skip("no AVX512-BF16 copy here: prompt rows read the fp8 pages in place")
    want = dequantize_fp8_table(codes.view(torch.uint8)[ids], exps[ids].unsqueeze(-1), dtype)
    assert got.dtype == dtype and torch.equal(got, want)
    assert int((want == 0).sum()) >= 8 and bool((codes.view(torch.uint8)[1, 0, 0, :2] & 0x78 == 0).any())


@pytest.mark.parametrize("amx", [True, False], ids=["amx", "vector"])
@pytest.mark.parametrize("qdtype", [torch.bfloat16, torch.float32], ids=["bf16_q", "fp32_q"])
@pytest.mark.parametrize("head_dim,group", [(64, 3), (64, 8), (128, 1)])
def test_prompt_rows_over_dequantised_pages_give_the_fp8_calls_bits(amx: bool, qdtype: torch.dtype, head_dim: int,
                                                                      group: int) -> None:
    """A prompt chunk's tiles over its pages dequantised first (as backend/attention.py runs prompt rows over FP8
    pages) give the bits the call over the fp8 pages gives: the same products (code x 2^e is exact in bfloat16 and
    float32, where the fp8 copy applies 2^e to scores and weights instead), on the AMX tiles and the vector copy."""
    with vector_copy():
        if amx and not amx_tiles(True):
            pytest.skip("no AMX tiles here (the CPU, the build, or the kernel's tile state)")
        lens = [187]
        num_pages, page_table = random_layout(lens)
        paged = build_paged(random_sequences(lens, 2, head_dim), 2, head_dim, FP8, num_pages, page_table, "cpu")
        start, n = 150, 37
        pages = -(-lens[0] // 16)
        ids = paged.page_table[0, :pages].long()
        k = dequantised_pages(paged.k_cache, paged.k_scale, ids, qdtype)
        v = dequantised_pages(paged.v_cache, paged.v_scale, ids, qdtype)
        if k is None:
            pytest.skip("no AVX512-BF16 copy here: prompt rows read the fp8 pages in place")
        q = torch.randn(n, 2 * group, head_dim).to(qdtype)
        keys = torch.arange(start + 1, start + n + 1, dtype=torch.int32)
        tiles = torch.tensor(list(range(0, n, tile_rows(group))) + [n], dtype=torch.int32)
        in_place = paged_decode_attention_cpu(q, *paged._replace(page_table=paged.page_table[:1].expand(n, -1),
                                                                 context_lens=keys), 0.125, tiles=tiles)
        over = paged_decode_attention_cpu(q, k, v, None, None, torch.arange(pages).expand(n, -1), keys, 0.125,
                                          tiles=tiles)
        assert in_place is not None and over is not None
        assert torch.equal(in_place, over)
