"""The INT4 GEMV (kernels/cpu/gemv_int4.c: AVX512-BF16, its AVX-512F copy in gemv_int4_avx512f.h or its AVX2 copy
in gemv_int4_avx2.h, whichever this CPU builds, and the copies it skips built with their instruction sets turned
off) against a float64 reference of the dequantised weight, on fresh random inputs: every x-tile
shape (1-8 rows, 1-4 on AVX2; balanced tiles past them, row blocks past 64), N not a
multiple of the 16-row panel, K not a multiple of the 8-column step or of the group (a partial last group),
group sizes 8-256, 1-3 threads, the vdpbf16ps tiles and (where the CPU has AMX) the AMX tiles; weights whose
groups are far from centred (the 136 s X term then cancels most of the sum) and all-zero scales; packing and
`Int4Linear` on it."""

from __future__ import annotations

import pytest
import torch

from backend.cpu_features import cpu_flags
from kernels import cpu_gemv
from kernels.cpu_build import CKernel
from kernels.cpu_gemv_int4 import KERNEL, PANEL, available, build_error, gemv_int4, pack
from kernels.w4a16_gemm import dequantize_int4_ref, quantize_int4_ref, unpack_int4_ref
from tests.kernels.test_kv_store import seed  # noqa: F401  (fixture)

pytestmark = pytest.mark.skipif(not available(), reason=f"INT4 GEMV not built for this CPU: {build_error()}")


def _quantised(n: int, k: int, group: int, offset: float = 0.0) -> tuple[torch.Tensor, ...]:
    """(codes, scales, zeros, the float64 weight they stand for) of a random [n, k] weight, rows of
    different magnitudes, plus `offset` (groups far from centred)."""
    w = torch.randn(n, k) * torch.exp2(torch.empty(n, 1).uniform_(-3, 3)) * 0.05 + offset
    q, s, z = quantize_int4_ref(w, group)
    return unpack_int4_ref(q), s, z, dequantize_int4_ref(q, s, z, group, k).double()


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, seed: int) -> None:
    """Within bfloat16's rounding of the result (half an ulp) plus float32 sums and the cancellation of the
    136 s X term (2^-14 of sum |x w| at worst, the C file's header)."""
    ref = x.double() @ w.t()
    bound = ref.abs() * 2.0 ** -8 + 2.0 ** -13 * (x.double().abs() @ w.abs().t())
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape
    bad = (y.double() - ref).abs() > bound
    assert not bad.any(), f"seed {seed}: {int(bad.sum())} of {bad.numel()} outside bfloat16 rounding"


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("m,k,n,group", [(1, 576, 960, 32), (2, 576, 1539, 128), (3, 40, 7, 8), (4, 1536, 576, 128),
                                         (1, 64, 1, 64), (5, 100, 13, 32), (6, 576, 33, 256), (7, 72, 9, 8),
                                         (8, 1536, 17, 32), (9, 36, 8, 32), (13, 520, 23, 128), (32, 576, 100, 32),
                                         (33, 1536, 62, 128), (70, 96, 40, 32), (130, 44, 18, 16)])
@pytest.mark.parametrize("tiles", ["dp", "amx"])
def test_matches_reference(m: int, k: int, n: int, group: int, threads: int, tiles: str, seed: int) -> None:
    codes, s, z, w = _quantised(n, k, group)
    x = torch.randn(m, k).bfloat16()
    _check(gemv_int4(x, pack(codes, s, z, group), threads, tiles=tiles), x, w, seed)


# The copies this CPU's own build may skip, built with the instruction sets turned off (-march=native's later -mno-*
# flags win): the AVX-512F copy on an AVX512-BF16 host, the AVX2 copy on any AVX-512 host.
_COPIES = {"avx512f": CKernel("gemv_int4.c", ("-mno-avx512bf16", "-mno-amx-bf16", "-mno-amx-tile"), KERNEL.declare,
                              "test only", uses_pool=True),
           "avx2": CKernel("gemv_int4.c", ("-mno-avx512f",), KERNEL.declare, "test only", uses_pool=True)}


@pytest.mark.parametrize("copy", sorted(_COPIES))
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("m,k,n,group", [(1, 576, 960, 32), (2, 576, 1539, 128), (3, 40, 7, 8), (5, 100, 13, 32),
                                         (8, 1536, 17, 32), (13, 520, 23, 128), (33, 1536, 62, 128),
                                         (70, 96, 40, 32)])
def test_other_copies_match_reference(copy: str, m: int, k: int, n: int, group: int, threads: int,
                                      seed: int) -> None:
    if copy == "avx512f" and "avx512f" not in cpu_flags():
        pytest.skip("no AVX-512F on this CPU")
    lib = _COPIES[copy].load()  # this host builds its own copy (the module's skip), so it builds this one too
    assert lib is not None, f"{copy} copy did not build: {_COPIES[copy].error}"
    codes, s, z, w = _quantised(n, k, group)
    x = torch.randn(m, k).bfloat16()
    packed = pack(codes, s, z, group)
    k8 = packed.k8
    xp = x if k8 == k else torch.nn.functional.pad(x, (0, k8 - k)).contiguous()
    y = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    assert lib.gemv_int4(xp.data_ptr(), packed.codes.data_ptr(), packed.scales_zeros.data_ptr(), y.data_ptr(), m, n,
                         k8, group, threads, 3, 0) == 0
    _check(y, x, w, seed)


@pytest.mark.parametrize("tiles", ["dp", "amx"])
@pytest.mark.parametrize("m", [1, 8, 32])
def test_groups_far_from_centred(m: int, tiles: str, seed: int) -> None:
    """Weights around 3 with a spread of 0.05: z ~ 3 and s ~ 0.01, so s D and (z - 136 s) X are both large
    and of opposite sign for x summing to about zero; the result still holds bfloat16's rounding."""
    codes, s, z, w = _quantised(48, 512, 32, offset=3.0)
    x = torch.randn(m, 512).bfloat16()
    _check(gemv_int4(x, pack(codes, s, z, 32), 1, tiles=tiles), x, w, seed)


@pytest.mark.skipif(not (cpu_gemv.available() and cpu_gemv.amx_available()), reason="no AMX tiles on this CPU")
def test_the_amx_tiles_run_where_the_cpu_has_them(seed: int) -> None:
    """Their sums run in another order than the vdpbf16ps tiles', so some results round differently: the AMX
    path ran (not a silent fallback), and both are right."""
    codes, s, z, w = _quantised(2048, 4096, 128)
    x = torch.randn(32, 4096).bfloat16()
    panels = pack(codes, s, z, 128)
    amx, dp = gemv_int4(x, panels, 2, tiles="amx"), gemv_int4(x, panels, 2, tiles="dp")
    _check(amx, x, w, seed)
    _check(dp, x, w, seed)
    assert not torch.equal(amx, dp)


def test_threads_split_panels_without_changing_a_bit(seed: int) -> None:
    """Each output comes whole from one thread's panel: the thread count changes nothing."""
    codes, s, z, _ = _quantised(1000, 576, 32)
    packed = pack(codes, s, z, 32)
    for m in (1, 6, 32):
        x = torch.randn(m, 576).bfloat16()
        assert torch.equal(gemv_int4(x, packed, 1), gemv_int4(x, packed, 2))


def test_zero_scales_give_zeros_and_rows_past_n_are_never_written() -> None:
    codes = torch.randint(0, 16, (20, 64))
    s = torch.zeros(20, 2, dtype=torch.bfloat16)
    packed = pack(codes, s, s.clone(), 32)
    assert packed.codes.shape[0] == 2 and packed.scales_zeros.shape == (2, 2, 2, PANEL)
    x = torch.randn(3, 64).bfloat16()
    y = gemv_int4(x, packed, 1)
    assert y.shape == (3, 20) and torch.equal(y, torch.zeros_like(y))
    assert gemv_int4(torch.empty(0, 64, dtype=torch.bfloat16), packed, 2).shape == (0, 20)


def test_packing_rejects_what_the_kernel_cannot_run() -> None:
    codes = torch.randint(0, 16, (16, 48))
    s = torch.ones(16, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 8"):
        pack(codes, s, s, 12)
    with pytest.raises(ValueError, match="do not match"):
        pack(codes, s[:, :2], s[:, :2], 16)
    packed = pack(codes, s[:, :3], s[:, :3], 16)
    for x in (torch.randn(2, 40).bfloat16(), torch.randn(2, 48), torch.randn(48).bfloat16()):
        with pytest.raises(ValueError, match="not bfloat16"):
            gemv_int4(x, packed)


def test_packed_layout_is_the_c_files(seed: int) -> None:
    """Byte 2i and 2i + 1 of panel p's 64 bytes for columns 8t..8t+7 hold, nibble by nibble, row 16p + i's
    columns 8t + 2j + e (j = nibble 0..3 of the 16-bit word, e = which byte pair lane): decode it back."""
    codes, s, z, _ = _quantised(32, 24, 8)
    packed = pack(codes, s, z, 8)
    words = packed.codes.view(2, 3, PANEL, 2, 2).view(torch.int16).view(2, 3, PANEL, 2).to(torch.int32) & 0xFFFF
    back = torch.empty(2, PANEL, 24, dtype=torch.int64)
    for t in range(3):
        for j in range(4):
            for e in range(2):
                back[:, :, 8 * t + 2 * j + e] = (words[:, t, :, e] >> (4 * j)) & 0xF
    assert torch.equal(back.reshape(32, 24), codes.long())
    assert torch.equal(packed.scales_zeros[1, 2, 0], s[16:32, 2].bfloat16())
    assert torch.equal(packed.scales_zeros[0, 1, 1], z[:16, 1].bfloat16())


def test_the_choice_against_torch_is_timed_and_can_be_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    """`pays()` follows the timing (here made to favour torch's op, then the kernel) unless forced."""
    from kernels import cpu_gemv_int4

    real_measure = cpu_gemv_int4.measure
    for c_time, expected in ((2.0, False), (0.5, True)):
        cpu_gemv_int4._faster_than_torch.cache_clear()
        monkeypatch.setattr(cpu_gemv_int4, "measure", lambda c=c_time: {"c": c, "torch": 1.0})
        monkeypatch.setenv("EDGESERVE_INT4_GEMV", "auto")
        assert cpu_gemv_int4.pays() is expected
        monkeypatch.setenv("EDGESERVE_INT4_GEMV", "1")
        assert cpu_gemv_int4.pays() is True
        monkeypatch.setenv("EDGESERVE_INT4_GEMV", "0")
        assert cpu_gemv_int4.pays() is False
    cpu_gemv_int4._faster_than_torch.cache_clear()
    times = real_measure(reps=1)  # the real probe runs both GEMMs
    assert set(times) == {"c", "torch"} and all(0 < t < 1 for t in times.values())
