"""Paged decode attention on the CPU without gathering the context (C, built on first use).

The torch path of `backend/attention.py` gathers every decoding sequence's pages into a
contiguous [D, L, kv_heads, head_dim] copy in the compute dtype, then runs SDPA: for
FP8 pages that copy is also a dequantisation (a table lookup and a scale multiply over
the whole context, per layer, per step), which made FP8 pages slower than BF16 ones
at equal concurrency on this CPU. `kernels/cpu/paged_decode.c` instead walks each
(sequence, KV head)'s pages in place: one page row at a time is converted to float32
into a buffer that stays in L1 (fp8: bit placement plus two exact power-of-two
multiplies, no table; bf16: a shift), dotted with the G query heads of that KV head,
and folded into an online softmax (blocks of 32 tokens); values the same way. The
bytes read are the pool's own: half of BF16's for FP8.

Numerics: float32 throughout, like the torch path with compute dtype float32; the
dequantised values are bit-identical to `kernels.kv_store.dequantize_fp8_ref`, and the
result differs from the gather + SDPA reference by summation order and by the softmax's
exponentials, which a branch-free polynomial computes within 2 ulp of `expf` so the loop
vectorises (tests compare within 1e-5 relative on fresh random inputs). A sequence's keys
are found page by page, without a division per token. bfloat16 queries are widened exactly
and scored by float32 FMAs, so the bfloat16 output is the widened call's, rounded (decode rows
everywhere; prompt tiles where the CPU has no AVX512-BF16, see below). CPUs with
AVX512-BF16 had copies that scored them by `vdpbf16ps` straight from the page rows (FP8 keys
made their exact bfloat16 values in registers) until 2026-12-07; the float32 copies for
decode rows and prompt tiles took, on a Zen 4 VM, 0.64x (FP8 pages) and 0.91x (BF16) of
their time for 32 decode rows of 2,000 keys, and 0.55-0.7x for a prompt's tiles (the C
file's comments). Prompt tiles with bfloat16 queries over bfloat16 or FP8 pages on those CPUs
(`pair_tiles()`) do score by `vdpbf16ps`, with the tile's heads along the lanes: a query head's
dims c, c+1 as one word times key j's broadcast, and for P . V two keys' V rows interleaved into
words times a head's two weights broadcast, each weight rounded to bfloat16 first, as on the AMX
tiles below (so the output is within 3 bfloat16 rounding units of the reference, ~1.6 measured).
Half the instructions of the float32 tile: a 1,024-row prompt chunk 0.61x the time, a bfloat16
engine's 1,024-token TTFT 0.89x and 2,048-token 0.83x (Zen 4 VM; the C file's `attend_pairs16`).
Decode rows on AMX tiles score by `tdpbf16ps`.

On a CPU with AMX (tiles for bfloat16 products), rows with bfloat16 queries run on the tile unit
(`attend_amx` in the C file): over FP8 pages every row, over bfloat16 pages decode rows of at least
128 keys and every prompt tile (in groups of at most 16 query heads, each head masked at its own
row's keys). Scores of 16 keys by up to 16 query heads per tile product from the page rows as they
lie (FP8: each block's rows made their exact bfloat16 values in L1 first), the softmax over 128 keys
at a time, and P . V per 16 keys with V's rows as they lie too (the weights spread with zeros
between them, so one product sums the even dims and another the odd ones). The weights enter that
product rounded to bfloat16, as flash attention on GPUs rounds them to 16 bits, and the softmax's
sum adds the rounded weights: the output is within 3 bfloat16 rounding units (2^-8) of its magnitude
(the sum of |weight| |V|; ~1.5 measured), where the vector copy is within one. SmolLM2's shape, 32
rows x 30 layers' own pools, 2 threads, 2-core AMX Xeon VM, the two copies alternating: bfloat16
pages 0.85x the vector copy's time at 1,024 keys, 0.91x at 256, even at 128, slower below (hence the
128); FP8 pages 0.54x at 1,024, 0.61-0.63x at 64-256, 0.88x at 16, so FP8 pages now take 1.18x
bfloat16's time at 1,024 keys (1.6x before). A 1,024-row prompt chunk in tiles of 10 rows over 30
layers: 421 -> 100 ms (bf16 pages), 654 -> 156 (FP8, in place); a 1,024-token prefill in a bfloat16
engine 0.93 -> 0.47 s, and 0.39 s since a prompt tile's softmax runs lane-wise (the C file's AMX
section); float32 engines pass float32 queries, which keep the vector copy. Prompt rows over FP8
pages are better served by `dequantised_pages` (their pages converted once per call, not once per
tile; the caller then runs them over that bf16 or float32 pool, the same bits). Decode rows read
the pages at ~14 GB/s where the GEMVs read ~28: scattered page rows bound both copies more than
arithmetic does. `amx_tiles(False)` or
`EDGESERVE_AMX_ATTENTION=0` keeps the vector copy.

On an AVX2 CPU without AVX-512, decode rows run their own loop (`attend_dec8`): a work item's KV
heads together (a token's rows of them lie side by side in the page), each key row converted to
float32 once, in registers (bf16: a 32-byte load gives the even dims by a shift and the odd ones by
a mask; q and the output are kept in that order; fp8, where the CPU has F16C: the e4m3 bits placed
as float16 bits, exactly 2^-8 of the values, the 2^8 folded into the scores' multiplier and the
output's 1 / l), the softmax eight keys a vector. Same arithmetic summed in another order. A c = 32
SmolLM2 bfloat16 decode step at 1,024 tokens of context on a 2-core AMD EPYC VM (`edgeserve bench
token-profile --prompt-tokens 1024`, old and new alternating): the attention 66-70 -> 56-61 ms a
step (of ~140) over bf16 pages; over FP8 pages (before: the older loop, one KV head an item) 49-54 -> 40-43 ms,
~0.8x bf16's time.

Prompt rows (a prefill chunk: each row a query whose keys end at its own position) come
in tiles (`tiles`): up to 32 query heads (10 rows x G = 3 for SmolLM2) run together
against each block of 32 keys, so a block's K and V rows are read and widened once per
tile instead of once per row; in the block on a row's causal diagonal its later keys are
left out of the softmax. Same VM, 2 threads, bfloat16 pages: 5 prompts of 103 rows
1283 -> ~1000 us, one of 160 650 -> 506 us, two of 256 2858 -> 2221 us. On AVX2 (no AVX-512) a
tile's query heads lie along the vector lanes: Q transposed once per tile, each score vector one
key against 8 heads (a key's value broadcast times Q's columns, no horizontal sums), the softmax
lane by lane, the outputs of 6 heads a pass over each block's V rows. Against the per-head loop it
replaced (2-core AMD EPYC VM, SmolLM2 bfloat16 engine): the attention of a 4,000-token prompt
0.70x the time, its TTFT 12.7-14.4 -> 10.3-12.7 s; of a 1,000-token prompt 0.71x, TTFT 0.92x.

Build (`kernels/cpu_build.py`): `gcc -O3 -march=native` plus the reassociation flags that
let the compiler vectorise float sums (`-fassociative-math -fno-signed-zeros
-fno-trapping-math`, not `-ffast-math`: no flush-to-zero), cached per source, flags,
compiler and CPU. Without a C compiler (or when the build fails) `available()` is False,
the reason is logged once, and the torch path runs.
Threads: the process's shared helper pool (`kernels/cpu/pool.c`, also the bf16 GEMV's), or torch's OpenMP
pool in steps whose GEMMs run on torch's threads (`cpu_threads.run_mode`); either claims (sequence, KV
head) pairs one at a time, `cpu_threads.kernel_threads()` threads when the step's context is large enough
to pay for waking them. A thread started per call (before) cost
more than it saved: at 32 sequences of 150 tokens (SmolLM2's shape, bf16 pages, 2-core AMD EPYC
VM) a call took 297 µs at 2 threads against 335 at one; with the pool and the AVX-512 loop, 117.
"""

from __future__ import annotations

import ctypes
import os

import torch

from kernels.cpu_build import CKernel
from kernels.cpu_threads import kernel_threads, run_mode

__all__ = ["KERNEL", "available", "paged_decode_attention_cpu", "build_error", "tile_rows", "THREADED_ROWS",
           "fp8_as_bf16", "pair_tiles", "amx_tiles", "amx_default", "dequantised_pages", "dequantises"]

_FORMATS = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2}
THREADED_ROWS = 4096  # (sequence, KV head, token) rows below which one thread does the whole step
_TILE_QUERIES = 32  # query heads of one tile, at most (the kernel's MAX_G)


def _declare(lib: ctypes.CDLL) -> None:
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.paged_decode.argtypes = [p, p, p, p, p, p, p, p, i, p, i, i, i, i, i, i, i, i, ctypes.c_float, i,
                                 ctypes.c_int64, i]
    lib.paged_decode.restype = ctypes.c_int
    lib.fp8_to_bf16.argtypes = [p, p, i, i]
    lib.fp8_to_bf16.restype = ctypes.c_int
    lib.fp8_pages_dequantise.argtypes = [p, p, p, i, i, i, i, p, i]
    lib.fp8_pages_dequantise.restype = ctypes.c_int
    lib.paged_decode_pair_tiles.argtypes = []
    lib.paged_decode_pair_tiles.restype = ctypes.c_int
    lib.paged_decode_set_amx.argtypes = [i]
    lib.paged_decode_set_amx.restype = ctypes.c_int
    lib.paged_decode_set_amx(int(amx_default()))


KERNEL = CKernel("paged_decode.c", ("-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math",
                                     "-fno-math-errno"), _declare, "decode attention gathers pages instead",
                  uses_pool=True)


available = KERNEL.available  # whether it builds and loads here (builds it on the first call)
build_error = KERNEL.build_error  # why not, or None


def tile_rows(group: int) -> int:
    """Rows of one prompt chunk a tile may hold when a KV head serves `group` query heads."""
    return max(1, _TILE_QUERIES // group)


def paged_decode_attention_cpu(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                               k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                               page_table: torch.Tensor, context_lens: torch.Tensor, scale: float,
                               threads: int | None = None, tiles: torch.Tensor | None = None
                               ) -> torch.Tensor | None:
    """Decode attention [D, heads, head_dim] in q's dtype (float32 or bfloat16; other dtypes run in
    float32) for q [D, heads, head_dim] over pages [P, PAGE_SIZE, kv_heads, head_dim] (fp32, bf16, or
    fp8_e4m3 with exponents [P, PAGE_SIZE, kv_heads]), page_table [D, maxP] and context_lens [D] (each
    >= 1). bfloat16 q is widened exactly and the float32 result rounded to nearest even, as
    `.to(torch.bfloat16)` would, in the kernel (two torch copies per layer fewer). `threads`: None
    lets the kernel use `kernel_threads()` when the call has at least `THREADED_ROWS` key rows.
    `tiles` (int32 [n + 1], first rows of n tiles then D; None: every row alone): rows a tile holds
    share their page table and see non-decreasing key counts (a prompt chunk's rows), and run together
    against each block of keys (`tile_rows` says how many rows a tile may hold).
    None when the kernel cannot run this case (not built, another page dtype, a head_dim over 256):
    the caller takes the torch path."""
    lib = KERNEL.load()
    fmt = _FORMATS.get(k_pages.dtype)
    d, heads, hd = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    if lib is None or fmt is None or k_pages.is_cuda or not (k_pages.is_contiguous() and v_pages.is_contiguous()):
        return None
    if q.dtype not in (torch.float32, torch.bfloat16):
        q = q.float()
    q = q.contiguous()
    table = page_table.to(torch.int64).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    if tiles is not None:
        tiles = tiles.to(torch.int32).contiguous()
    if fmt == 2:
        k_scale, v_scale = k_scale.contiguous(), v_scale.contiguous()
    out = torch.empty(d, heads, hd, dtype=q.dtype)
    min_rows = 0 if threads is not None else THREADED_ROWS
    rc = lib.paged_decode(q.data_ptr(), k_pages.data_ptr(), v_pages.data_ptr(),
                          k_scale.data_ptr() if fmt == 2 else None, v_scale.data_ptr() if fmt == 2 else None,
                          table.data_ptr(), lens.data_ptr(), None if tiles is None else tiles.data_ptr(),
                          0 if tiles is None else tiles.numel() - 1, out.data_ptr(), d, kv_heads, heads // kv_heads, hd,
                          page_size, table.shape[1], fmt, int(q.dtype == torch.bfloat16), scale,
                          kernel_threads() if threads is None else threads, min_rows, run_mode())
    return out if rc == 0 else None


def pair_tiles() -> bool:
    """Whether prompt tiles with bfloat16 queries over bf16 or fp8 pages run by `vdpbf16ps` here (the C file's
    `attend_pairs16`: weights rounded to bfloat16, as on the AMX tiles), else widened to float32."""
    lib = KERNEL.load()
    return lib is not None and bool(lib.paged_decode_pair_tiles())


def amx_default() -> bool:
    """Whether this process runs the AMX tiles where they apply unless switched (`EDGESERVE_AMX_ATTENTION=0`: not)."""
    return os.environ.get("EDGESERVE_AMX_ATTENTION", "1") != "0"


def amx_tiles(on: bool) -> bool:
    """Switch the AMX tiles for decode rows over bf16 or fp8 pages with bf16 queries (`attend_amx` in the C file;
    on by default where built, `EDGESERVE_AMX_ATTENTION=0` off) for this process, e.g. for a benchmark's comparison.
    Returns whether this build and process have them (False: the vector copy runs either way)."""
    lib = KERNEL.load()
    return bool(lib is not None and lib.paged_decode_set_amx(int(on)))


def fp8_as_bf16(codes: torch.Tensor, by_table: bool = False) -> torch.Tensor | None:
    """The exact bfloat16 values of fp8_e4m3 `codes` (uint8, any length; zero-padded to a multiple of 32 inside)
    by the kernel's in-register conversion, which the AMX tiles and `dequantised_pages` use where the CPU has no
    AVX512-VBMI. None where the kernel has no AVX512-BF16 copy. `by_table`: the conversion they use where it has
    (two 128-byte tables read by `vpermi2b`), None without AVX512-VBMI."""
    lib = KERNEL.load()
    if lib is None:
        return None
    n, width = codes.numel(), 64 if by_table else 32
    src = torch.zeros((n + width - 1) // width * width, dtype=torch.uint8)
    src[:n] = codes.reshape(-1)
    dst = torch.empty(src.numel(), dtype=torch.int16)
    if lib.fp8_to_bf16(src.data_ptr(), dst.data_ptr(), src.numel(), int(by_table)) != 0:
        return None
    return dst[:n].view(torch.bfloat16).view(codes.shape)


def dequantised_pages(pages: torch.Tensor, exps: torch.Tensor, page_ids: torch.Tensor,
                      dtype: torch.dtype) -> torch.Tensor | None:
    """Pages `page_ids` [P] (int64) of an fp8_e4m3 pool [N, PAGE_SIZE, kv_heads, head_dim] with exponents
    [N, PAGE_SIZE, kv_heads] as a new pool [P, PAGE_SIZE, kv_heads, head_dim] of their true values (code x 2^e,
    exact) in `dtype` (bfloat16 or float32): what a prompt chunk's rows attend to, converted once per call
    instead of once per tile of rows (`backend/attention.py`). Equal to `kernels.kv_store.dequantize_fp8_table`
    on the same rows. None where the kernel is not built or has no AVX512-BF16 copy, or head_dim is not a
    multiple of 32: the caller reads the fp8 pages in place."""
    lib = KERNEL.load()
    if lib is None or dtype not in (torch.bfloat16, torch.float32) or not (pages.is_contiguous()
                                                                         and exps.is_contiguous()):
        return None
    _, page_size, kv_heads, hd = pages.shape
    ids = page_ids.to(torch.int64).contiguous()
    out = torch.empty(ids.numel(), page_size, kv_heads, hd, dtype=dtype)
    rc = lib.fp8_pages_dequantise(pages.data_ptr(), exps.data_ptr(), ids.data_ptr(), ids.numel(), page_size,
                                  kv_heads, hd, out.data_ptr(), int(dtype == torch.float32))
    return out if rc == 0 else None


def dequantises(head_dim: int) -> bool:
    """Whether `dequantised_pages` runs here for pages of `head_dim` (else prompt rows read FP8 pages in place)."""
    pages = torch.zeros(1, 16, 1, head_dim, dtype=torch.float8_e4m3fn)
    return dequantised_pages(pages, torch.zeros(1, 16, 1, dtype=torch.int8), torch.tensor([0]),
                             torch.float32) is not None
