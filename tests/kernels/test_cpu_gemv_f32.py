"""The float32 GEMV (kernels/cpu/gemv_f32.c: AVX-512F, its AVX2 copy in gemv_f32_avx2.h, or plain C, whichever
this CPU builds) against a float64 reference, on fresh random inputs: 1-8 rows (the per-row code) and 13 and 32
(the 6 x 4 tiles, AVX2's 4 x 2, with x rows and weight rows left over), N and K that are not multiples of the
tiles, the 16- or 8-column steps or the 4-row thread split, 1-3 threads and several chunk counts; the same on
copies built here without AVX-512 and without AVX2 (where this CPU has them), so every copy is tested on
this host; the argument checks and `call_plan`'s layout."""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_gemv, cpu_gemv_f32
from kernels.cpu_build import CKernel
from kernels.cpu_gemv_f32 import KERNEL, available, build_error, call_plan, gemv_f32
from tests.kernels.test_kv_store import seed  # noqa: F401  (fixture)

pytestmark = pytest.mark.skipif(not available(), reason=f"float32 GEMV not built for this CPU: {build_error()}")

ROWS = [1, 2, 3, 5, 8, 13, 32, 64]
SHAPES = [(576, 960), (577, 1539), (31, 7), (1537, 62), (16, 4), (1, 3), (100, 13)]  # (K, N)


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, seed: int) -> None:
    """Within float32 sums' rounding: each copy sums in chains of at most K / 4 FMAs (the plain C copy's four;
    the vector copies' 8-16 lanes are shorter) and a tree of at most 8 levels, each step rounding by at most
    2^-24 of the running sum's magnitude, itself at most sum |x w|."""
    ref = x.double() @ w.double().t()
    bound = (x.shape[1] // 4 + 8) * 2.0 ** -24 * (x.double().abs() @ w.double().abs().t()) + 1e-30
    assert y.dtype == torch.float32 and y.shape == ref.shape
    bad = (y.double() - ref).abs() > bound
    assert not bad.any(), f"seed {seed}: {int(bad.sum())} of {bad.numel()} outside float32 rounding"


@pytest.mark.parametrize("threads,chunks", [(1, None), (2, None), (2, 1), (2, 7), (3, 64)])
@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("m", ROWS)
def test_matches_reference(m: int, k: int, n: int, threads: int, chunks: int | None, seed: int) -> None:
    x = torch.randn(m, k)
    w = torch.randn(n, k) * 0.05
    _check(gemv_f32(x, w, threads, chunks), x, w, seed)


def test_close_to_torch(seed: int) -> None:
    """At SmolLM2's shapes, within float32-level relative error of torch's own float32 GEMM."""
    for m, k, n in [(1, 576, 960), (8, 576, 3072), (32, 1536, 576)]:
        x, w = torch.randn(m, k), torch.randn(n, k) * 0.05
        torch.testing.assert_close(gemv_f32(x, w, 2), torch.nn.functional.linear(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m", [2, 13])
def test_reads_only_its_rows(m: int, seed: int) -> None:
    """A weight that is a row slice of a larger buffer, and an x row slice: the rows around them (NaN) are never
    read."""
    big = torch.full((20, 70), float("nan"))
    big[3:16] = torch.randn(13, 70)
    xbig = torch.full((m + 4, 70), float("nan"))
    xbig[2:m + 2] = torch.randn(m, 70)
    _check(gemv_f32(xbig[2:m + 2], big[3:16], 2), xbig[2:m + 2], big[3:16], seed)


def test_strided_x_is_copied(seed: int) -> None:
    x = torch.randn(40, 9).t()  # [9, 40], not contiguous
    w = torch.randn(11, 40)
    _check(gemv_f32(x, w, 1), x, w, seed)


@pytest.mark.parametrize("threads", [1, 2])
def test_zero_rows_compute_and_write_nothing(threads: int) -> None:
    """Empty results for M = 0 or N = 0; the C entry point handed M = 0 touches neither x nor y."""
    w = torch.randn(4096, 64)
    assert gemv_f32(torch.empty(0, 64), w, threads).shape == (0, 4096)
    assert gemv_f32(torch.randn(3, 64), torch.empty(0, 64), threads).shape == (3, 0)
    x = torch.full((8, 64), float("nan"))
    y = torch.full((8, 4096), 7.0)
    lib = cpu_gemv_f32.KERNEL.load()
    assert lib.gemv_f32(x.data_ptr(), w.data_ptr(), y.data_ptr(), 0, 4096, 64, threads, 8) == 0
    assert bool((y == 7.0).all())


def test_zero_k_gives_zeros() -> None:
    assert bool((gemv_f32(torch.empty(3, 0), torch.empty(5, 0), 1) == 0).all())


@pytest.mark.parametrize("x,w,match", [
    (torch.randn(2, 8).bfloat16(), torch.randn(4, 8), "x is torch.bfloat16"),
    (torch.randn(2, 8), torch.randn(4, 8).double(), "weight is torch.float64"),
    (torch.randn(8), torch.randn(4, 8), "x has shape"),
    (torch.randn(2, 8), torch.randn(4, 8, 1), "weight has shape"),
    (torch.randn(2, 8), torch.randn(4, 9), "differ in K"),
    (torch.randn(2, 8), torch.randn(8, 4).t(), "not contiguous"),
])
def test_rejects_bad_arguments(x: torch.Tensor, w: torch.Tensor, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        gemv_f32(x, w)


def test_call_plan_has_cpu_gemv_layout() -> None:
    """(threads, chunks, 0): cpu_gemv.call_plan's tuple, so a caller can take either; a float32 weight is twice
    a bfloat16 one's bytes, so at most twice its chunks."""
    for m, k, n in [(1, 576, 960), (32, 1536, 576), (4, 64, 8)]:
        plan = call_plan(m, n, k, 2)
        assert isinstance(plan, tuple) and len(plan) == len(cpu_gemv.call_plan(m, n, k, 2)) == 3
        threads, chunks, third = plan
        assert threads == 2 and third == 0 and chunks >= 2
    assert call_plan(1, 960, 576, 1) == (1, 1, 0)
    assert call_plan(1, 8, 8)[:2] == (1, 1)  # too small to share, whatever torch's threads


def test_address_is_the_entry_point() -> None:
    """The address a fused C file would call: the same function ctypes calls."""
    addr = cpu_gemv_f32.address()
    assert addr == cpu_gemv_f32.KERNEL.address("gemv_f32") and addr
    fn = ctypes.CFUNCTYPE(ctypes.c_int, *([ctypes.c_void_p] * 3), *([ctypes.c_int] * 5))(addr)
    x, w, y = torch.randn(3, 20), torch.randn(9, 20), torch.empty(3, 9)
    assert fn(x.data_ptr(), w.data_ptr(), y.data_ptr(), 3, 9, 20, 1, 1) == 0
    torch.testing.assert_close(y, x @ w.t(), rtol=1e-5, atol=1e-5)


def _declare(lib: ctypes.CDLL) -> None:
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.gemv_f32.argtypes = [p, p, p, i, i, i, i, i]
    lib.gemv_f32.restype = ctypes.c_int


# The copies this CPU's own build skips: built here with the instruction sets turned off (-march=native's
# later -mno-* flags win), so the AVX2 and plain-C code run on an AVX-512 host too.
_COPIES = {"avx2": CKernel("gemv_f32.c", ("-mno-avx512f",), _declare, "test only", uses_pool=True),
           "plain": CKernel("gemv_f32.c", ("-mno-avx2", "-mno-fma"), _declare, "test only", uses_pool=True)}


@pytest.mark.parametrize("copy", sorted(_COPIES))
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("k,n", SHAPES[:5])
@pytest.mark.parametrize("m", ROWS)
def test_other_copies_match_reference(copy: str, m: int, k: int, n: int, threads: int, seed: int) -> None:
    lib = _COPIES[copy].load()
    if lib is None:
        pytest.skip(f"{copy} copy not built here: {_COPIES[copy].error}")
    x, w = torch.randn(m, k), torch.randn(n, k) * 0.05
    y = torch.full((m, n), float("nan"))
    assert lib.gemv_f32(x.data_ptr(), w.data_ptr(), y.data_ptr(), m, n, k, threads, 5) == 0
    _check(y, x, w, seed)


@pytest.mark.parametrize("flags,limit", [({"avx2", "fma", "avx512f"}, 32), ({"avx2", "fma"}, 128), ({"avx2"}, 8),
                                         ({"sse4_2"}, 8)])
def test_the_row_limit_follows_the_vector_units(monkeypatch: pytest.MonkeyPatch, flags: set[str], limit: int) -> None:
    """Each copy's measured range: AVX-512 up to 32 rows, the AVX2 copy up to 128, plain C only where a GEMV is
    bound by reading the weights (8)."""
    monkeypatch.setattr(cpu_gemv_f32, "cpu_flags", lambda: frozenset(flags))
    assert cpu_gemv_f32.max_rows() == limit


def test_linear_takes_it_up_to_its_row_limit(monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """A float32 `Linear` runs the kernel up to `max_rows()` rows and torch's GEMM past it; both right."""
    from backend.linear import Linear

    limit = cpu_gemv_f32.max_rows()
    assert limit in (cpu_gemv_f32.MAX_ROWS, cpu_gemv_f32.AVX2_MAX_ROWS, cpu_gemv_f32.PLAIN_MAX_ROWS)
    calls: list[int] = []
    kernel = cpu_gemv_f32.gemv_f32
    monkeypatch.setattr(cpu_gemv_f32, "gemv_f32", lambda x, w: calls.append(x.shape[0]) or kernel(x, w))
    w, bias = torch.randn(96, 80), torch.randn(96)
    lin = Linear(w, bias, buckets=(8, 32))
    assert lin.gemv and lin.gemv_rows == limit and lin.takes_gemv(limit) and not lin.takes_gemv(limit + 1)
    for rows in (1, limit, limit + 1):  # the last one is torch's GEMM
        x = torch.randn(rows, 80)
        torch.testing.assert_close(lin(x).double(), F.linear(x.double(), w.double(), bias.double()),
                                   rtol=1e-5, atol=1e-5)
    assert calls == [1, limit]
    assert not Linear(w.t().contiguous().t()).gemv  # a strided view


@pytest.mark.parametrize("copy", ["native", *sorted(_COPIES)])
@pytest.mark.parametrize("m", [1, 5, 8, 13, 32])
@pytest.mark.parametrize("k", [77, 1539])  # 1539: the AVX2 tiles' blocks of K
def test_an_output_does_not_depend_on_where_its_row_falls(copy: str, m: int, k: int, seed: int) -> None:
    """A slice of the weight's rows (a tensor-parallel shard, the last N % 4 rows of a call) gives its outputs
    bit for bit as the whole weight does: the tensor-parallel engine agrees with one process."""
    lib = KERNEL.load() if copy == "native" else _COPIES[copy].load()
    if lib is None:
        pytest.skip(f"{copy} copy not built here")
    x, w = torch.randn(m, k), torch.randn(50, k)

    def run(rows: torch.Tensor, threads: int) -> torch.Tensor:
        y = torch.empty(m, rows.shape[0])
        assert lib.gemv_f32(x.data_ptr(), rows.data_ptr(), y.data_ptr(), m, rows.shape[0], k, threads, 3) == 0
        return y

    whole = run(w, 2)
    for start, stop in [(0, 25), (25, 50), (3, 10), (47, 50), (1, 2)]:
        assert torch.equal(run(w[start:stop].contiguous(), 1), whole[:, start:stop]), (start, stop)
