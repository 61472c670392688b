"""The decode GEMV of bfloat16 linear layers on CPUs with AVX512-BF16 or AVX2 (C, built on first use).

`kernels/cpu/gemv_bf16.c` computes y = x . W^T for bfloat16 x [M, K] and W [N, K] with
`vdpbf16ps` (exact bfloat16 products, float32 sums), reading the weights once at close to
the memory's rate. It is used for steps of up to `max_rows()` rows (a decode step, or one with a
short prompt chunk): at a few rows a GEMV is bound by reading the weights and torch's bfloat16 GEMM
ran at about half that rate (measured with `edgeserve bench token-profile`); from 7 rows the work is
compute-bound and runs in 4 x 4 tiles, either of `vdpbf16ps` or of float32 FMAs on weights widened
in registers (x widened once per call), or, on CPUs with AMX (Sapphire Rapids and later), of AMX tiles
(`tdpbf16ps`: 32 weight rows by 32 x rows a block). Which is faster depends on the core (on the Intel Xeon VM
measured, `vdpbf16ps` does 75 GFLOP/s a core and float32 FMAs 123; on an AMD EPYC (Zen 5) VM the
vdpbf16ps tiles run at 90-100% of torch's own peak bfloat16 GEMM rate from 64 rows; on an AMX Xeon the AMX
tiles took a third of the FMA tiles' time at 16 rows), so `tile_mode()` times those the CPU has once per process
and keeps the fastest (`EDGESERVE_GEMV_TILES=dp|fma|amx` forces one), and the row limit follows the choice
(`MAX_ROWS_BY_TILES`). The C file has the numbers.
The result is rounded to bfloat16 in C (to nearest, ties to even), as torch's bfloat16 GEMM returns
it; it differs from torch's only in summation order.

Threads: `cpu_threads.kernel_threads()` (the caller and a pool of helpers kept between calls) for
weights of at least `_THREADED_BYTES` in a step that handed torch's threads over
(`cpu_threads.torch_single_threaded`), of at least `_SHARED_THREADED_BYTES` (in practice the LM
head) in one where torch's OpenMP workers may be spinning on the other cores. The rows are cut
into chunks of about `_CHUNK_BYTES` of weights that the threads claim one at a time, so a helper
that is asleep or preempted costs at most one chunk (the C file's header). A thread started per
call (before) lost to one thread at every layer size on a 2-core VM (starting it took longer than
its share); a static OpenMP split won in process and lost end to end, waiting on a worker the OS
had given to another process.
Without AVX512-BF16 the build takes the AVX-512F copy (`kernels/cpu/gemv_bf16_avx512f.h`: float32 FMAs on 16
lanes, the FMA tiles, x widened every call; `tile_mode()` is then "avx512", nothing to time) where the CPU has
AVX-512F, else the AVX2 copy (`kernels/cpu/gemv_bf16_avx2.h`: the same on 8 lanes, its own tiles; "avx2"). Each
has its own row limit. With neither AVX512-BF16 nor AVX2 and FMA the build fails, `available()` is False and
`Linear` keeps torch's GEMM.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import time

import torch

from backend.cpu_features import cpu_flags, has_avx512_bf16
from kernels.cpu_build import CKernel
from kernels.cpu_threads import kernel_threads, kernels_own_threads

__all__ = ["KERNEL", "available", "build_error", "call_plan", "gemv_bf16", "max_rows", "mixed_step_tokens",
           "tile_code", "amx_available", "AVX2_MIXED_STEP_TOKENS", "AVX512_MIXED_STEP_TOKENS",
           "AMX_MIN_ROWS", "MAX_ROWS_BY_TILES", "PER_ROW_MAX",
           "TILE_MODES", "tile_mode", "measure_tiles"]

log = logging.getLogger(__name__)

# x rows (tokens of a step) up to which Linear runs the kernel and a step hands torch's threads over to it
# (`max_rows`), per tile kernel. Its time over torch's bfloat16 GEMM's, SmolLM2's linears: 0.55x at 1 row, 0.80x
# at 4, 0.77x at 6 (2-core Zen 4, per-row code only); with the vdpbf16ps tiles, 2-core Intel Xeon VM, 2 threads
# each: 0.59-0.81x at 8, 0.67-0.85x at 16, 0.85-1.09x at 32, 0.86-1.03x at 64 (the FMA tiles there: 0.77-0.93x
# the vdpbf16ps tiles' time at 8-32 rows, all 121 linears), so FMA-tile hosts stop at 32. On a 2-core AMD EPYC
# VM (Zen 5 by its flags; vdpbf16ps tiles) the fused linears of 30 layers, each in its own process: 0.58x at 32
# rows, 0.64x at 64, 0.74x at 128, 0.81x at 192, 0.85x at 256, 1.0x at 512; but a step past the limit keeps
# torch's threads for its other ops (the prompt's attention), so the limit is set by whole steps, the limits
# alternating step by step in one engine (31 decode rows plus a prompt chunk, medians of 8): 0.79-0.92x at 63-128
# tokens, 0.97x at 159, 1.09x at 255. So vdpbf16ps hosts take the kernel up to 128 rows.
# The AVX2 copy (gemv_bf16_avx2.h: CPUs without AVX512-BF16), against torch on SmolLM2's four linear shapes on a
# 2-core AMD EPYC VM with AVX2 only (Zen 3 by its flags), 2 threads, bfloat16 GEMM time / float32 GEMM (MKL, on
# float32 copies of the weights) / the kernel's: 1 row 0.71 / 0.61 / 0.47 ms, 4 rows 3.1 / 1.6 / 0.67, 16 rows
# 10.5 / 3.2 / 2.7, 32 rows 16.1 / 4.7 / 3.8, 64 rows 32 / 9.4 / 7.5, 128 rows 65 / 12.9 / 15.6 (torch's
# bfloat16 GEMM is emulated there, ~16 GFLOP/s; from 128 rows bfloat16 GEMMs run widened to float32 where that
# pays, backend/gemm_widen.py). So it takes every call below the widened GEMMs' rows: "avx2" 128.
# The AMX tiles on a 2-core Intel Xeon with AMX (Sapphire Rapids class), SmolLM2's 121 linears streamed, 2 threads
# (`edgeserve bench cpu-kernels --sections linear`, torch's bfloat16 GEMM on oneDNN's own AMX kernels): 0.58x
# torch's time at 8 rows, 0.65x at 32, 0.77x at 64, 0.87x at 128, where the FMA tiles took 1.7x torch's at 32
# rows and 2.6x at 64: "amx" 128.
MAX_ROWS_BY_TILES = {"dp": 128, "fma": 32, "avx2": 128, "avx512": 128, "amx": 128}
# Tokens a step with decode rows holds by default (`mixed_step_tokens`). Where the tiles are the fastest path up to
# max_rows (AVX512-BF16 hosts, measured above) that is max_rows: decode rows and a prompt chunk share a step in the
# kernel's range. On the AVX2 host the tiles run ~65 GFLOP/s at 128 rows where float32 GEMMs on widened weights
# run 87-100 from 128 rows, so a larger step gains more in its prompt rows than its decode rows lose: 32 requests
# of 80 prompt and 64 output tokens took 23.0 / 24.6 s at a cap of 128 tokens, 17.0 / 19.7 / 18.7 s at 256,
# 20.1 s at 384, 20.5 s uncapped (512).
# The AVX-512F copy (tiles at 170-190 GFLOP/s where float32 GEMMs ran 250-320) is best uncapped, at the step's
# 512 tokens: on a 2-core Ice Lake-SP VM, the c = 32 round of `bench engine --quick` (32 requests, 2,492 prompt and
# 726 output tokens) in process, caps alternating, s: 128 tokens 7.6-8.1, 256 4.8-6.4, 384 4.4-5.0, 512 4.1-6.1
# (0.79-0.98x 256's time in each of 7 paired rounds; float32 beside them 0.85-0.98x 512's).
AVX2_MIXED_STEP_TOKENS = 256
AVX512_MIXED_STEP_TOKENS = 512
_THREADED_BYTES = 256 << 10  # weights below this run on the calling thread alone (too short to share)
_SHARED_THREADED_BYTES = 16 << 20  # the same while torch's OpenMP workers may spin (outside a handover)
_CHUNK_BYTES = 128 << 10  # of weights per chunk the threads claim (a few per thread at SmolLM2's sizes)


def _declare(lib: ctypes.CDLL) -> None:
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.gemv_bf16.argtypes = [p, p, p, i, i, i, i, i, i]
    lib.gemv_bf16.restype = ctypes.c_int
    lib.gemv_bf16_amx_ready.argtypes = []
    lib.gemv_bf16_amx_ready.restype = ctypes.c_int


KERNEL = CKernel("gemv_bf16.c", (), _declare, "bfloat16 decode GEMVs run torch's GEMM", uses_pool=True)


available = KERNEL.available  # whether it builds and loads here (builds it on the first call)
build_error = KERNEL.build_error  # why not, or None


PER_ROW_MAX = 6  # rows the C file's per-row code takes (its CHUNK); more take the tiles
AMX_MIN_ROWS = 3  # rows past which the AMX tiles take a call instead (the C file's AMX_MIN_ROWS: faster from 4 rows)
TILE_MODES = ("dp", "fma", "amx")  # the C file's tile kernels for more than PER_ROW_MAX rows: vdpbf16ps, FMAs, AMX
_TILE_CODE = {"dp": 0, "fma": 1, "amx": 2, "avx2": 0, "avx512": 0}  # the C entry's `fma` argument
_TILE_MARGIN = 1.1  # the FMA tiles only where they are at least this much faster
_PROBE = (16, 576, 1536)  # rows, in_features, out_features of the timed call


@functools.lru_cache(maxsize=1)
def amx_available() -> bool:
    """Whether the AMX tiles run here: the kernel was built with AMX-TILE and AMX-BF16 and Linux granted this
    process the tile state."""
    lib = KERNEL.load()
    return bool(lib is not None and lib.gemv_bf16_amx_ready())


def measure_tiles(reps: int = 5) -> dict[str, float]:
    """Seconds of one `_PROBE` call per tile mode this CPU has, one thread: the fastest of `reps` interleaved runs
    on fresh random operands."""
    rows, k, n = _PROBE
    x, w = torch.randn(rows, k).to(torch.bfloat16), torch.randn(n, k).to(torch.bfloat16)
    modes = [m for m in TILE_MODES if m != "amx" or amx_available()]
    best = dict.fromkeys(modes, float("inf"))
    for mode in modes:  # warm
        gemv_bf16(x, w, 1, tiles=mode)
    for _ in range(reps):
        for mode in modes:
            t = time.perf_counter()
            gemv_bf16(x, w, 1, tiles=mode)
            best[mode] = min(best[mode], time.perf_counter() - t)
    return best


@functools.lru_cache(maxsize=1)
def tile_mode() -> str:
    """The tile kernel for calls of more than PER_ROW_MAX rows on this CPU, timed once per process
    (`EDGESERVE_GEMV_TILES=dp|fma|amx` forces it)."""
    forced = os.environ.get("EDGESERVE_GEMV_TILES", "auto")
    if forced in TILE_MODES:
        return forced
    if not has_avx512_bf16():  # the AVX-512F or AVX2 build: its own tiles, nothing to choose (the C call ignores `fma`)
        return "avx512" if "avx512f" in cpu_flags() else "avx2"
    times = measure_tiles()
    mode = "fma" if times["dp"] >= _TILE_MARGIN * times["fma"] else "dp"
    if times.get("amx", float("inf")) < times[mode]:
        mode = "amx"
    log.info("bf16 GEMV tiles: %s (%s; %d rows)", mode,
             ", ".join(f"{m} {t * 1e3:.3f} ms" for m, t in times.items()), _PROBE[0])
    return mode


def max_rows() -> int:
    """Rows up to which `Linear` runs the kernel and a step of that many tokens hands torch's threads over
    (`MAX_ROWS_BY_TILES` for this CPU's tile kernel, `tile_mode()`)."""
    return MAX_ROWS_BY_TILES[tile_mode()]


def mixed_step_tokens() -> int:
    """Tokens a step with decode rows holds by default where every linear runs this kernel (the engine's
    `mixed_step_tokens=None`): `max_rows()`, or the measured cap of a copy without vdpbf16ps (AVX2, AVX-512F)."""
    return {"avx2": AVX2_MIXED_STEP_TOKENS, "avx512": AVX512_MIXED_STEP_TOKENS}.get(tile_mode(), max_rows())


def gemv_bf16(x: torch.Tensor, weight: torch.Tensor, threads: int | None = None,
              tiles: str | None = None) -> torch.Tensor:
    """x [M, K] . weight [N, K]^T -> [M, N] bfloat16, for contiguous bfloat16 CPU tensors and
    any M (one pass over the weights; `Linear` calls it up to `max_rows()`; `available()` first).
    `tiles` picks the kernel for more than PER_ROW_MAX rows (`TILE_MODES`; default: `tile_mode()`)."""
    lib = KERNEL.load()
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=torch.bfloat16)
    if m == 0:  # a prefill chunk that completes no prompt has no logits rows
        return y
    x = x.contiguous()
    threads, chunks, fma = call_plan(m, n, k, threads, tiles)
    if lib.gemv_bf16(x.data_ptr(), weight.data_ptr(), y.data_ptr(), m, n, k, threads, chunks, fma) != 0:
        raise MemoryError(f"bf16 GEMV: no memory to widen a [{m}, {k}] input")
    return y


def call_plan(m: int, n: int, k: int, threads: int | None = None, tiles: str | None = None) -> tuple[int, int, int]:
    """(threads, chunks, fma) of a call with x [m, k] and weight [n, k]: the threads by the weights' bytes
    (`threads` if given), chunks of about `_CHUNK_BYTES`, and the tile code of `tiles` (else `tile_mode()`): 1 for
    the FMA tiles past PER_ROW_MAX rows, 2 for the AMX tiles past AMX_MIN_ROWS, else 0. `gemv_bf16` and the fused
    decode layers (`cpu_decode_layers`) split alike."""
    threads, chunks = weight_plan(n * k * 2, threads)
    mode = tiles or tile_mode()
    return threads, chunks, tile_code(mode) if m > (AMX_MIN_ROWS if mode == "amx" else PER_ROW_MAX) else 0


def tile_code(tiles: str | None = None) -> int:
    """The C entry's `fma` argument for `tiles` (default: `tile_mode()`) at any row count: the C file takes the
    tiles only past their own row thresholds (those `call_plan` applies), so a caller that does not know its rows
    in advance (`cpu_moe_experts`) passes this."""
    return _TILE_CODE[tiles or tile_mode()]


def weight_plan(nbytes: int, threads: int | None = None) -> tuple[int, int]:
    """(threads, chunks) of a GEMV call over `nbytes` of weights: threaded from `_THREADED_BYTES` in a step that
    handed torch's threads over, from `_SHARED_THREADED_BYTES` outside one (`threads` if given), chunks of about
    `_CHUNK_BYTES`. The bfloat16 and float32 GEMVs split alike (`cpu_gemv_f32.call_plan`)."""
    if threads is None:
        floor = _THREADED_BYTES if kernels_own_threads() else _SHARED_THREADED_BYTES
        threads = kernel_threads() if nbytes >= floor else 1
    return threads, max(threads, nbytes // _CHUNK_BYTES) if threads > 1 else 1
