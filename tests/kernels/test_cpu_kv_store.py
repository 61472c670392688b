"""The C KV stores (`kernels/cpu_kv_store.py`: FP8 and plain pools) write the bytes of `store_kv_ref`, on fresh
random inputs."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu_kv_store import available, build_error, store_kv_fp8_cpu, store_kv_rows_cpu
from kernels.kv_store import store_kv_ref
from tests.kernels.test_kv_store import seed  # noqa: F401  (fixture)

pytestmark = pytest.mark.skipif(not available(), reason=f"CPU kernel not built: {build_error()}")

PAGES, PAGE_SIZE = 6, 16


def _pools(heads: int, dim: int) -> tuple[torch.Tensor, ...]:
    """K and V pages and exponents, filled with random bytes (a store must overwrite exactly its rows)."""
    pages = torch.randint(0, 256, (2, PAGES, PAGE_SIZE, heads, dim), dtype=torch.uint8).view(torch.float8_e4m3fn)
    scales = torch.randint(-64, 64, (2, PAGES, PAGE_SIZE, heads), dtype=torch.int8)
    return pages[0], pages[1], scales[0], scales[1]


def _hard_values(tokens: int, heads: int, dim: int) -> torch.Tensor:
    """float32 rows spanning the range the format meets: magnitudes 2^-150..2^110 (both exponent clamps,
    float32 subnormals), all-zero rows, signed zeros, and elements exactly halfway between two e4m3
    values (a float32 whose bits below the kept 3 mantissa bits are 1000...0 stays a tie after the
    exact 2^-e scaling)."""
    x = torch.randn(tokens, heads, dim) * torch.exp2(torch.randint(-150, 110, (tokens, heads, 1)).float())
    bits = x.view(torch.int32)
    ties = torch.rand(tokens, heads, dim) < 0.3
    bits[ties] = (bits[ties] & ~0xFFFFF) | 0x80000
    x[torch.rand(tokens, heads) < 0.15] = 0.0
    x[torch.rand(tokens, heads, dim) < 0.02] = -0.0
    return x


def _both(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    ref = _pools(k.shape[1], k.shape[2])
    ours = tuple(t.clone() for t in ref)
    store_kv_ref(k, v, *ref, slots)
    assert store_kv_fp8_cpu(k, v, *ours, slots)
    as_bytes = lambda ts: [t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for t in ts]  # noqa: E731
    return as_bytes(ref), as_bytes(ours)


@pytest.mark.parametrize("tokens,heads,dim", [(1, 3, 64), (5, 2, 128), (40, 4, 64), (96, 4, 64)])  # 96: on the pool
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_same_bytes_as_the_reference(tokens: int, heads: int, dim: int, dtype: torch.dtype, seed: int) -> None:
    k = _hard_values(tokens, heads, dim).to(dtype)
    v = _hard_values(tokens, heads, dim).to(dtype)
    slots = torch.randperm(PAGES * PAGE_SIZE)[:tokens]
    ref, ours = _both(k, v, slots)
    for name, a, b in zip(("k", "v", "k_scale", "v_scale"), ref, ours, strict=True):
        assert torch.equal(a, b), f"{name} differs at {(a != b).nonzero()[:5].tolist()} (seed {seed})"


def test_strided_inputs(seed: int) -> None:
    """K and V as views of one fused projection output (rows not contiguous), as attention hands them over."""
    qkv = _hard_values(7, 8, 64)
    k, v = qkv[:, 2:5], qkv[:, 5:8]
    ref, ours = _both(k, v, torch.randperm(PAGES * PAGE_SIZE)[:7])
    assert all(torch.equal(a, b) for a, b in zip(ref, ours, strict=True)), seed


def test_non_finite_values_land_as_the_reference_writes_them() -> None:
    k = torch.randn(3, 2, 64)
    k[0, 0, 5], k[1, 1, 9], k[2, 0, 0] = float("inf"), float("nan"), float("-inf")
    ref, ours = _both(k, k.clone(), torch.tensor([3, 40, 77]))
    assert all(torch.equal(a, b) for a, b in zip(ref, ours, strict=True))


def test_a_slot_outside_the_pool_writes_nothing() -> None:
    pools = _pools(3, 64)
    before = [t.view(torch.uint8).clone() if t.dtype == torch.float8_e4m3fn else t.clone() for t in pools]
    k = torch.randn(2, 3, 64)
    with pytest.raises(IndexError):
        store_kv_fp8_cpu(k, k, *pools, torch.tensor([1, PAGES * PAGE_SIZE]))
    after = [t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for t in pools]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_declines_what_it_does_not_read() -> None:
    pools = _pools(3, 64)
    k = torch.randn(2, 3, 64)
    slots = torch.tensor([0, 1])
    assert not store_kv_fp8_cpu(k.half(), k.half(), *pools, slots)  # float16 input
    assert not store_kv_fp8_cpu(k, k, *pools, slots.int())  # int32 slots
    assert not store_kv_fp8_cpu(k.transpose(1, 2).contiguous().transpose(1, 2), k, *pools, slots)  # head_dim strided
    bf16_pages = torch.zeros(PAGES, PAGE_SIZE, 3, 64, dtype=torch.bfloat16)
    assert not store_kv_fp8_cpu(k, k, bf16_pages, bf16_pages, pools[2], pools[3], slots)


# -- plain pools: store_kv_rows_cpu -------------------------------------------------------------------------
def _plain_pools(heads: int, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V pages of `dtype` holding random bytes (a store must overwrite exactly its rows)."""
    raw = torch.randint(-2**15, 2**15, (2, PAGES, PAGE_SIZE, heads, dim * (dtype.itemsize // 2)), dtype=torch.int16)
    pages = raw.view(dtype)
    return pages[0], pages[1]


@pytest.mark.parametrize("tokens,heads,dim", [(1, 3, 64), (5, 2, 128), (40, 4, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("strided", [False, True])
def test_plain_store_writes_the_reference_bytes(tokens: int, heads: int, dim: int, dtype: torch.dtype,
                                                strided: bool, seed: int) -> None:
    if strided:  # K and V as views of one fused projection output, as attention hands them over
        qkv = torch.randn(tokens, 3 * heads, dim).to(dtype)
        k, v = qkv[:, heads:2 * heads], qkv[:, 2 * heads:]
    else:
        k, v = torch.randn(tokens, heads, dim).to(dtype), torch.randn(tokens, heads, dim).to(dtype)
    slots = torch.randperm(PAGES * PAGE_SIZE)[:tokens]
    ref = _plain_pools(heads, dim, dtype)
    ours = tuple(t.clone() for t in ref)
    store_kv_ref(k, v, *ref, None, None, slots)
    assert store_kv_rows_cpu(k, v, *ours, slots)
    for name, a, b in zip(("k", "v"), ref, ours, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"{name} differs (seed {seed})"


def test_plain_store_with_a_slot_outside_the_pool_writes_nothing() -> None:
    pools = _plain_pools(3, 64, torch.bfloat16)
    before = [t.clone() for t in pools]
    k = torch.randn(2, 3, 64).to(torch.bfloat16)
    for bad in (PAGES * PAGE_SIZE, -1):
        with pytest.raises(IndexError):
            store_kv_rows_cpu(k, k, *pools, torch.tensor([1, bad]))
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(before, pools, strict=True))


def test_plain_store_declines_what_it_does_not_read() -> None:
    k_pool, v_pool = _plain_pools(3, 64, torch.bfloat16)
    k = torch.randn(2, 3, 64).to(torch.bfloat16)
    slots = torch.tensor([0, 1])
    assert not store_kv_rows_cpu(k.float(), k.float(), k_pool, v_pool, slots)  # another dtype than the pool's
    assert not store_kv_rows_cpu(k, k, k_pool, v_pool, slots.int())  # int32 slots
    assert not store_kv_rows_cpu(k.transpose(1, 2).contiguous().transpose(1, 2), k, k_pool, v_pool, slots)
    assert not store_kv_rows_cpu(k, k, k_pool[:, :, :2], v_pool, slots)  # another head count
    assert not store_kv_rows_cpu(k[:1], k[:1], k_pool, v_pool, slots)  # slots and tokens disagree


def test_pools_off_the_cpu_are_declined_not_written() -> None:
    """A pool on another device (a GPU's; here `meta`, which has no memory) is never handed to the C stores: they
    decline, and the caller takes the pool's own device path (a GPU pool's pointers in C were a segfault)."""
    k = torch.randn(3, 2, 16)
    slots = torch.arange(3)
    rows = torch.empty(4, 8, 2, 16, device="meta")
    assert store_kv_rows_cpu(k, k, rows, rows, slots) is False
    fp8 = torch.empty(4, 8, 2, 16, dtype=torch.float8_e4m3fn, device="meta")
    exps = torch.empty(4, 8, 2, dtype=torch.int8, device="meta")
    assert store_kv_fp8_cpu(k, k, fp8, fp8, exps, exps, slots) is False
