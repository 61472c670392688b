"""The decode GEMV (kernels/cpu/gemv_bf16.c: AVX512-BF16, its AVX-512F copy in gemv_bf16_avx512f.h or its AVX2
copy in gemv_bf16_avx2.h, whichever this CPU builds, and the copies it skips built with their instruction sets
turned off) against a float64 reference, on fresh random inputs: K and N that are not multiples of the kernel's
16 or 32 columns or 4-row thread split, 1-6 rows (the per-row code) and 7-33 rows (the tiles: vdpbf16ps and
float32-FMA 4 x 4, AVX2's 4 x 2, AMX's 32 x 32 blocks where the CPU has AMX, with rows and weight rows left over),
1-3 threads;
and `Linear` taking it for bfloat16 weights at decode row counts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from backend.cpu_features import cpu_flags
from backend.gemm_widen import widening_pays
from backend.linear import Linear
from kernels import cpu_gemv
from kernels.cpu_build import CKernel
from kernels.cpu_gemv import MAX_ROWS_BY_TILES, TILE_MODES, available, build_error, gemv_bf16
from tests.kernels.test_kv_store import seed  # noqa: F401  (fixture)

pytestmark = pytest.mark.skipif(not available(), reason=f"bf16 GEMV not built for this CPU: {build_error()}")


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, seed: int) -> None:
    """Within bfloat16's rounding of the result (half an ulp) plus float32 sums' order (tiny)."""
    ref = x.double() @ w.double().t()
    bound = ref.abs() * 2.0 ** -8 + 1e-5 * (x.double().abs() @ w.double().abs().t())
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape
    bad = (y.double() - ref).abs() > bound
    assert not bad.any(), f"seed {seed}: {int(bad.sum())} of {bad.numel()} outside bfloat16 rounding"


@pytest.mark.parametrize("tiles", TILE_MODES)
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("m,k,n", [(1, 576, 960), (2, 577, 1539), (3, 31, 7), (4, 1536, 576), (1, 64, 1), (4, 96, 6),
                                   (5, 100, 13), (6, 576, 33), (7, 65, 9), (8, 1536, 17), (11, 130, 10),
                                   (9, 31, 8), (10, 33, 5), (13, 577, 23), (16, 64, 4), (32, 576, 1539),
                                   (33, 1536, 62)])
def test_matches_reference(m: int, k: int, n: int, threads: int, tiles: str, seed: int) -> None:
    x = torch.randn(m, k).bfloat16()
    w = (torch.randn(n, k) * 0.05).bfloat16()
    _check(gemv_bf16(x, w, threads, tiles=tiles), x, w, seed)


# The copies this CPU's own build may skip, built with the instruction sets turned off (-march=native's later -mno-*
# flags win): the AVX-512F copy on an AVX512-BF16 host, the AVX2 copy on any AVX-512 host.
_COPIES = {"avx512f": CKernel("gemv_bf16.c", ("-mno-avx512bf16", "-mno-amx-bf16", "-mno-amx-tile"),
                              cpu_gemv.KERNEL.declare, "test only", uses_pool=True),
           "avx2": CKernel("gemv_bf16.c", ("-mno-avx512f",), cpu_gemv.KERNEL.declare, "test only", uses_pool=True)}


@pytest.mark.parametrize("copy", sorted(_COPIES))
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("m,k,n", [(1, 576, 960), (3, 31, 7), (6, 576, 33), (7, 65, 9), (9, 31, 8), (13, 577, 23),
                                   (32, 576, 1539), (33, 1536, 62)])
def test_other_copies_match_reference(copy: str, m: int, k: int, n: int, threads: int, seed: int) -> None:
    if copy == "avx512f" and "avx512f" not in cpu_flags():
        pytest.skip("no AVX-512F on this CPU")
    lib = _COPIES[copy].load()  # this host builds its own copy (the module's skip), so it builds this one too
    assert lib is not None, f"{copy} copy did not build: {_COPIES[copy].error}"
    x, w = torch.randn(m, k).bfloat16(), (torch.randn(n, k) * 0.05).bfloat16()
    y = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    assert lib.gemv_bf16(x.data_ptr(), w.data_ptr(), y.data_ptr(), m, n, k, threads, 5, 0) == 0
    _check(y, x, w, seed)


@pytest.mark.parametrize("tiles", TILE_MODES)
@pytest.mark.parametrize("m", [2, 9])
def test_reads_only_its_rows(m: int, tiles: str, seed: int) -> None:
    """A weight that is a row slice of a larger buffer: the rows around it (NaN) are never read."""
    big = torch.full((20, 70), float("nan"), dtype=torch.bfloat16)
    big[3:16] = torch.randn(13, 70).bfloat16()
    x = torch.randn(m, 70).bfloat16()
    _check(gemv_bf16(x, big[3:16], 2, tiles=tiles), x, big[3:16], seed)


@pytest.mark.parametrize("threads", [1, 2])
def test_zero_rows_compute_and_write_nothing(threads: int) -> None:
    """A prefill chunk that completes no prompt asks the LM head for 0 rows: an empty result, and the kernel
    itself, handed M = 0, touches neither x nor y (its per-row code once read and wrote 6 rows here, which
    crashed prefill workers on prompts longer than a chunk)."""
    w = torch.randn(4096, 64).bfloat16()
    lin = Linear(w)
    assert lin.gemv and lin(torch.empty(0, 64, dtype=torch.bfloat16)).shape == (0, 4096)
    assert gemv_bf16(torch.empty(0, 64, dtype=torch.bfloat16), w, threads).shape == (0, 4096)
    lib = cpu_gemv.KERNEL.load()
    x = torch.full((6, 64), float("nan"), dtype=torch.bfloat16)
    y = torch.full((6, 4096), 7.0, dtype=torch.bfloat16)
    for fma in (0, 1, 2):
        assert lib.gemv_bf16(x.data_ptr(), w.data_ptr(), y.data_ptr(), 0, 4096, 64, threads, 8, fma) == 0
    assert bool((y == 7.0).all())


@pytest.fixture
def tiles_env(monkeypatch: pytest.MonkeyPatch):
    """Set EDGESERVE_GEMV_TILES for one test, the per-process choice forgotten before and after."""
    def force(value: str) -> None:
        monkeypatch.setenv("EDGESERVE_GEMV_TILES", value)
        cpu_gemv.tile_mode.cache_clear()

    yield force
    cpu_gemv.tile_mode.cache_clear()


@pytest.mark.parametrize("times, mode", [({"dp": 2.0, "fma": 1.0}, "fma"), ({"dp": 1.05, "fma": 1.0}, "dp"),
                                         ({"dp": 1.0, "fma": 2.0}, "dp"),
                                         ({"dp": 1.0, "fma": 0.8, "amx": 0.3}, "amx"),
                                         ({"dp": 1.0, "fma": 0.5, "amx": 0.6}, "fma"),
                                         ({"dp": 1.0, "fma": 2.0, "amx": 1.2}, "dp")])
def test_tile_mode_takes_the_fastest_tiles_and_fma_only_when_clearly_faster(tiles_env, monkeypatch: pytest.MonkeyPatch,
                                                                            times: dict[str, float], mode: str) -> None:
    """The FMA tiles only at least `_TILE_MARGIN` faster than vdpbf16ps's; the AMX tiles (timed only where the CPU
    has them) whenever they are the fastest."""
    tiles_env("auto")
    monkeypatch.setattr(cpu_gemv, "has_avx512_bf16", lambda: True)
    monkeypatch.setattr(cpu_gemv, "measure_tiles", lambda: times)
    assert cpu_gemv.tile_mode() == mode


@pytest.mark.parametrize("flags,mode,cap", [({"avx2", "fma"}, "avx2", cpu_gemv.AVX2_MIXED_STEP_TOKENS),
                                            ({"avx2", "fma", "avx512f"}, "avx512", cpu_gemv.AVX512_MIXED_STEP_TOKENS)])
def test_without_avx512_bf16_the_tiles_are_the_builds_own(tiles_env, monkeypatch: pytest.MonkeyPatch,
                                                          flags: set[str], mode: str, cap: int) -> None:
    """An AVX-512F or AVX2 build has only its own tiles: nothing to time, and the row limit and step cap are
    theirs."""
    tiles_env("auto")
    monkeypatch.setattr(cpu_gemv, "has_avx512_bf16", lambda: False)
    monkeypatch.setattr(cpu_gemv, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(cpu_gemv, "measure_tiles", lambda: pytest.fail("measured without a vdpbf16ps copy"))
    assert cpu_gemv.tile_mode() == mode and cpu_gemv.max_rows() == MAX_ROWS_BY_TILES[mode]
    assert cpu_gemv.mixed_step_tokens() == cap


@pytest.mark.parametrize("mode", TILE_MODES)
def test_tile_mode_can_be_forced(tiles_env, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    tiles_env(mode)
    monkeypatch.setattr(cpu_gemv, "measure_tiles", lambda: pytest.fail("measured although forced"))
    assert cpu_gemv.tile_mode() == mode


def test_measure_tiles_times_every_tile_kernel_this_cpu_has() -> None:
    times = cpu_gemv.measure_tiles(reps=2)
    assert set(times) == {m for m in TILE_MODES if m != "amx" or cpu_gemv.amx_available()}
    assert all(0 < t < 1 for t in times.values())


@pytest.mark.skipif(not cpu_gemv.amx_available(), reason="no AMX tiles on this CPU (or not granted)")
def test_the_amx_tiles_run_where_the_cpu_has_them(seed: int) -> None:
    """Their sums run in another order than the vdpbf16ps tiles', so over long rows some results round
    differently: the AMX path ran (not a silent fallback), and both are right."""
    x, w = torch.randn(32, 4096).bfloat16(), (torch.randn(2048, 4096) * 0.05).bfloat16()  # 64K sums: some round apart
    amx, dp = gemv_bf16(x, w, 2, tiles="amx"), gemv_bf16(x, w, 2, tiles="dp")
    _check(amx, x, w, seed)
    assert not torch.equal(amx, dp)


@pytest.mark.parametrize("mode", TILE_MODES)
def test_linear_takes_it_up_to_the_tiles_row_limit(tiles_env, monkeypatch: pytest.MonkeyPatch, mode: str,
                                                   seed: int, request: pytest.FixtureRequest) -> None:
    """`Linear` runs the kernel up to `max_rows()` rows, which follows the tile kernel chosen, and torch's GEMM
    past it; both right."""
    tiles_env(mode)
    monkeypatch.setenv("EDGESERVE_BF16_WIDEN", "0")  # the limit is under test (128 rows widen where that pays)
    # the per-process answer forgotten before and after (kept, it made every later bf16 engine in the test
    # session run emulated bfloat16 GEMMs: a later benchmark test took 44 s instead of 7)
    widening_pays.cache_clear()
    request.addfinalizer(widening_pays.cache_clear)
    limit = cpu_gemv.max_rows()
    assert limit == MAX_ROWS_BY_TILES[mode] and MAX_ROWS_BY_TILES["dp"] > MAX_ROWS_BY_TILES["fma"] >= 32
    calls: list[int] = []
    kernel = cpu_gemv.gemv_bf16
    monkeypatch.setattr(cpu_gemv, "gemv_bf16", lambda x, w: calls.append(x.shape[0]) or kernel(x, w))
    w = (torch.randn(96, 80) * 0.05).bfloat16()
    bias = torch.randn(96).bfloat16()
    lin = Linear(w, bias)
    assert lin.gemv
    for rows in (1, limit, limit + 1):  # the last one is torch's GEMM
        x = torch.randn(rows, 80).bfloat16()
        y = lin(x)
        ref = F.linear(x.double(), w.double(), bias.double())
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y.double(), ref, rtol=2 ** -7, atol=1e-2)
    assert calls == [1, limit]
    assert not Linear(w.t().contiguous().t()).gemv  # a strided view


def test_pool_under_back_to_back_calls_and_two_callers(seed: int) -> None:
    """The helper pool: many chunks per call, calls back to back (helpers spinning) and after a pause (helpers
    asleep), and two Python threads calling at once (one gets the pool, the other runs alone): every result right."""
    import threading
    import time

    shapes = [(1, 576, 1536), (3, 1536, 576), (6, 576, 577)]  # 1.7 MB, 1.7 MB, 0.6 MB: 13, 13, 5 chunks
    inputs = [((torch.randn(m, k)).bfloat16(), (torch.randn(n, k) * 0.05).bfloat16()) for m, k, n in shapes]
    errors: list[str] = []

    def caller(rounds: int) -> None:
        for r in range(rounds):
            for x, w in inputs:
                try:
                    _check(gemv_bf16(x, w, 2), x, w, seed)
                except AssertionError as exc:
                    errors.append(str(exc))
            if r % 10 == 9:
                time.sleep(0.002)  # past the helpers' spin: they sleep and are woken by the next call

    threads = [threading.Thread(target=caller, args=(40,)) for _ in range(2)]
    for t in threads:
        t.start()
    caller(20)
    for t in threads:
        t.join()
    assert not errors, errors[:3]
