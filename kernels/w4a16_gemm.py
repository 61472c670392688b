"""W4A16 GEMM: y = x @ W.T with INT4 group-wise weights dequantised in registers.

Reads the INT4 layout defined (with its numerics) in `backend/weight_formats.py`:

    qweight  uint8     [N, K/2]        two codes per byte along K: column 2j in the low nibble,
                                       column 2j + 1 in the high nibble
    scales   bfloat16  [N, ceil(K/g)]  one per (row, group of g columns); the last group may be partial
    zeros    bfloat16  [N, ceil(K/g)]  the value of the midpoint code 8
    W[n, k] = (q[n, k] - 8) * scales[n, k // g] + zeros[n, k // g]

`quantize_int4_ref` / `dequantize_int4_ref` here are the format's one implementation.

Two paths, by the number of rows M of x [M, K]:
- **GEMV** (M <= GEMV_MAX_M, decode): grid (cdiv(N, BLOCK_N), SPLIT_K). Each program reads [BLOCK_N,
  BLOCK_B] tiles of packed bytes as they lie (contiguous along K), seen as [BLOCK_N, SLOTS, HALF_G]: runs of
  HALF_G = min(g / 2, BLOCK_B) bytes, each inside one group, so BLOCK_B is free of the group size (a tile of a
  g = 32 weight is not 16 bytes a row). It splits the nibbles and takes the even and odd columns of x against
  them; per run the scale and zero leave the inner sum:
      sum_k x[k] W[n, k] = scale[n, g] * sum_k x[k] (q[n, k] - 8) + zero[n, g] * sum_k x[k]
  (two multiply-adds a weight byte). A nibble becomes q - 8 in float32 without an int -> float conversion
  (a slow instruction on GPUs): OR-ed into the mantissa of 2**23 it is the float 2**23 + q, and subtracting
  2**23 + 8 is exact. The decoded tile serves every row of x. With enough N tiles to fill the GPU (SPLIT_K =
  1) the program writes y in x's dtype: one launch. Otherwise K is split into ranges whose float32 partial sums
  [SPLIT_K, M, N] the launcher adds. A memory-bound GEMV needs bytes in flight: `gemv_tile` sizes the tiles.
  **Words forms** (`kernel="words"` / `"words-prefetch"`, M = 1, K a multiple of 8): the codes read as int32
  words (8 columns, column 8w + j at bits 4j) in chunks of min(4, g / 8) words, one group each. Nibbles 0-4 are
  masked in place and nibbles 5-7 from the word shifted by 20, each OR-ed into 2**23 at bit s = 4 (j % 5): the
  float 2**23 + q 2**s, and one multiply-add by 2**-s less 2**(23 - s) + 8 gives q - 8 exactly (no shift a
  nibble, no int -> float conversion). Per weight one logic op and two multiply-adds; bfloat16 x is read as
  int32 pairs and widened by a shift or a mask. Sums stay inside a thread over a chunk; scale and zero apply
  per chunk (the identity above). Against the bytes form, compiled for sm_90 (`edgeserve bench sass`): 11.0
  against 13.6 instructions a weight byte at g = 128, 13.0 against 15.1 at g = 32, 96 registers against 118;
  `"words-prefetch"` loads the next tile before decoding this one (more bytes in flight, 128 registers). Until
  a GPU has timed them the bytes form stays the default.
- **tiled GEMM** (larger M, prefill): grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)), a K loop
  of `tl.dot` on [BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N] tiles into a float32 accumulator.
BLOCK_K divides the group size, so a K tile needs one scale and one zero per row. A tile's packed bytes are
read as they lie (`_dequant_tile`, shared with the fused MoE: contiguous, so vector loads), split into nibbles
and interleaved in registers. (Each weight loading its own byte read every byte twice, one byte a load: 27
instructions a weight byte compiled for sm_90 at M = 64, now 18.9; the fused MoE's gate-up 53.6 with register
spills, now 15.5 without, `edgeserve bench sass`. Scaling after the dot instead, with the codes in it, cost
more: the dot no longer accumulates in place.)
Operands of the dots are x's dtype (float32: IEEE, no TF32); accumulation is float32.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.exact_div import div_exact
from kernels.paged_attention import _dot_dtype

__all__ = ["GEMV_MAX_M", "GEMV_KERNELS", "GemvTile", "gemv_tile", "w4a16_gemm", "w4a16_gemm_ref", "quantize_int4_ref",
           "dequantize_int4_ref", "unpack_int4_ref"]

GEMV_MAX_M = 8  # rows up to which the split-K GEMV path runs
GEMV_KERNELS = ("bytes", "words", "words-prefetch")  # the GEMV's forms (module doc)


# ---------------------------------------------------------------- helpers

@triton.jit
def _dequant_tile(q_ptr, s_ptr, z_ptr, offs_n, k0, mask_n, K, stride_qn, stride_sn, stride_sg,
                  GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] float32 weight tile at columns k0 .. k0 + BLOCK_K - 1 (inside one group): its
    packed bytes read as they lie (contiguous: vector loads), split into nibbles and interleaved in registers."""
    offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    packed = tl.load(q_ptr + offs_n[:, None] * stride_qn + offs_b[None, :],
                     mask=mask_n[:, None] & (offs_b[None, :] < K // 2), other=0).to(tl.int32)
    low = ((packed & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0  # q - 8 without a conversion
    high = ((packed >> 4) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
    centred = tl.interleave(low, high)  # [BLOCK_N, BLOCK_K]: column 2j from the low nibble of byte j
    group = k0 // GROUP
    scale = tl.load(s_ptr + offs_n * stride_sn + group * stride_sg, mask=mask_n, other=0.0).to(tl.float32)
    zero = tl.load(z_ptr + offs_n * stride_sn + group * stride_sg, mask=mask_n, other=0.0).to(tl.float32)
    return centred * scale[:, None] + zero[:, None]


# ---------------------------------------------------------------- kernels

@triton.jit
def _w4a16_gemv_kernel(
    # pointers
    x_ptr,  # [M, K]
    q_ptr,  # [N, K/2] uint8
    s_ptr, z_ptr,  # [N, groups] bfloat16
    out_ptr,  # y [M, N] (SPLIT_K 1) or float32 partial sums [SPLIT_K, M, N]
    # sizes
    M, N, K, bytes_per_split,
    # strides
    stride_xm, stride_qn, stride_sn, stride_sg, stride_os, stride_om,
    # meta-parameters
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
    HALF_G: tl.constexpr,
):
    """One program per (N tile, K range): every row of x against the range's packed bytes (module doc)."""
    SLOTS: tl.constexpr = BLOCK_B // HALF_G  # runs of HALF_G bytes in a tile, each inside one group
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_slot = tl.arange(0, SLOTS)
    tile = offs_slot[:, None] * HALF_G + tl.arange(0, HALF_G)[None, :]  # [SLOTS, HALF_G] byte offsets
    mask_n = offs_n < N
    q_rows = q_ptr + offs_n[:, None, None].to(tl.int64) * stride_qn
    s_rows = offs_n[:, None] * stride_sn
    b_start = pid_s * bytes_per_split
    b_end = tl.minimum(b_start + bytes_per_split, K // 2)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for b0 in range(b_start, b_end, BLOCK_B):
        cols = b0 + tile  # byte columns: weight columns 2 * cols (low nibble) and 2 * cols + 1 (high)
        mask_b = cols < b_end
        packed = tl.load(q_rows + cols[None, :, :], mask=mask_n[:, None, None] & mask_b[None, :, :],
                         other=0).to(tl.int32)  # [BLOCK_N, SLOTS, HALF_G]
        # code - 8 without an int -> float conversion: 2**23 + code has the code as its low mantissa bits
        low = ((packed & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
        high = ((packed >> 4) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
        slot_start = b0 + offs_slot * HALF_G
        groups = slot_start // (GROUP // 2)
        mask_g = mask_n[:, None] & (slot_start < b_end)[None, :]
        scale = tl.load(s_ptr + s_rows + groups[None, :] * stride_sg, mask=mask_g, other=0.0).to(tl.float32)
        zero = tl.load(z_ptr + s_rows + groups[None, :] * stride_sg, mask=mask_g, other=0.0).to(tl.float32)
        for m in tl.static_range(BLOCK_M):  # the codes above serve every row of x
            mask_x = mask_b & (tl.full([1, 1], m, tl.int32) < M)
            x_even = tl.load(x_ptr + m * stride_xm + 2 * cols, mask=mask_x, other=0.0).to(tl.float32)
            x_odd = tl.load(x_ptr + m * stride_xm + 2 * cols + 1, mask=mask_x, other=0.0).to(tl.float32)
            codes = tl.sum(low * x_even[None, :, :] + high * x_odd[None, :, :], axis=2)  # [BLOCK_N, SLOTS]
            x_sum = tl.sum(x_even + x_odd, axis=1)  # [SLOTS]
            part = tl.sum(codes * scale + x_sum[None, :] * zero, axis=1)  # [BLOCK_N]
            acc = tl.where(offs_m[:, None] == m, acc + part[None, :], acc)
    out_ptrs = out_ptr + pid_s * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & mask_n[None, :])


@triton.jit
def _words_dot(packed, x_ptr, words, mask_w, X_BF16: tl.constexpr, MASKED: tl.constexpr):
    """[BLOCK_N, CHUNKS, CW] int32 words of codes (word w: columns 8w .. 8w + 7, column 8w + j at bits 4j)
    against x: each chunk's sum of x_k (q_k - 8), [BLOCK_N, CHUNKS], and of x_k, [CHUNKS] (module doc). x is
    read at the words `mask_w` (MASKED) keeps."""
    high = packed >> 20  # nibbles 5, 6, 7 at bits 0, 4, 8
    part = tl.zeros(packed.shape, dtype=tl.float32)
    x_sum = tl.zeros(words.shape, dtype=tl.float32)
    for j in tl.static_range(8):
        if X_BF16:  # two bfloat16 columns in one int32: even column in the low half
            if j % 2 == 0:
                if MASKED:
                    pair = tl.load(x_ptr.to(tl.pointer_type(tl.int32)) + words * 4 + j // 2, mask=mask_w, other=0)
                else:
                    pair = tl.load(x_ptr.to(tl.pointer_type(tl.int32)) + words * 4 + j // 2)
                xj = (pair << 16).to(tl.float32, bitcast=True)
            else:
                xj = (pair & -65536).to(tl.float32, bitcast=True)
        elif MASKED:
            xj = tl.load(x_ptr + words * 8 + j, mask=mask_w, other=0.0).to(tl.float32)
        else:
            xj = tl.load(x_ptr + words * 8 + j).to(tl.float32)
        if j < 5:
            bits = packed & (0xF << (4 * (j % 5)))
        else:
            bits = high & (0xF << (4 * (j % 5)))
        # nibble j at bits s = 4 (j % 5) of its word: 2**23 + q 2**s, exactly; times 2**-s less 2**(23 - s) + 8
        # is q - 8, exactly (one multiply-add)
        centred = (bits | 0x4B000000).to(tl.float32, bitcast=True) * (1.0 / (1 << (4 * (j % 5)))) \
            - (8388608.0 / (1 << (4 * (j % 5))) + 8.0)
        part += centred * xj[None, :, :]
        x_sum += xj
    return tl.sum(part, axis=2), tl.sum(x_sum, axis=1)


@triton.jit
def _w4a16_gemv_words_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, out_ptr,  # as _w4a16_gemv_kernel's, M = 1
    N, K, bytes_per_split,
    stride_qn, stride_sn, stride_sg, stride_os,
    GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, PREFETCH: tl.constexpr,
):
    """The GEMV's words form (M = 1): packed bytes read as int32 words, nibbles decoded in place (module doc)."""
    CW: tl.constexpr = 4 if GROUP >= 32 else GROUP // 8  # words a chunk: 8 * CW columns inside one group
    CHUNKS: tl.constexpr = BLOCK_B // 4 // CW
    WORDS: tl.constexpr = CHUNKS * CW
    X_BF16: tl.constexpr = x_ptr.dtype.element_ty == tl.bfloat16
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_c = tl.arange(0, CHUNKS)
    tile = offs_c[:, None] * CW + tl.arange(0, CW)[None, :]  # [CHUNKS, CW] word offsets
    mask_n = offs_n < N
    q_rows = q_ptr.to(tl.pointer_type(tl.int32)) + offs_n[:, None, None].to(tl.int64) * (stride_qn // 4)
    s_rows = offs_n[:, None] * stride_sn
    w_start = pid_s * (bytes_per_split // 4)
    w_end = tl.minimum(w_start + bytes_per_split // 4, K // 8)
    w_full = w_start + (w_end - w_start) // WORDS * WORDS  # whole tiles: loads without a mask along K
    acc = tl.zeros([BLOCK_N, CHUNKS], dtype=tl.float32)
    if PREFETCH:  # the next tile's words are in flight while this one is decoded
        live = N * (w_start < w_full).to(tl.int32)  # rows to load, none past the whole tiles: a row mask
        ahead = tl.load(q_rows + (w_start + tile)[None, :, :], mask=(offs_n < live)[:, None, None], other=0)
    for w0 in range(w_start, w_full, WORDS):
        words = w0 + tile
        if PREFETCH:
            packed = ahead
            live = N * (w0 + WORDS < w_full).to(tl.int32)
            ahead = tl.load(q_rows + (words + WORDS)[None, :, :], mask=(offs_n < live)[:, None, None], other=0)
        else:
            packed = tl.load(q_rows + words[None, :, :], mask=mask_n[:, None, None], other=0)
        codes, x_sum = _words_dot(packed, x_ptr, words, None, X_BF16, False)
        groups = (w0 + offs_c * CW) // (GROUP // 8)
        scale = tl.load(s_ptr + s_rows + groups[None, :] * stride_sg, mask=mask_n[:, None], other=0.0)
        zero = tl.load(z_ptr + s_rows + groups[None, :] * stride_sg, mask=mask_n[:, None], other=0.0)
        acc += codes * scale.to(tl.float32) + x_sum[None, :] * zero.to(tl.float32)
    if w_full < w_end:  # the last, partial tile
        words = w_full + tile
        mask_w = words < w_end
        packed = tl.load(q_rows + words[None, :, :], mask=mask_n[:, None, None] & mask_w[None, :, :], other=0)
        codes, x_sum = _words_dot(packed, x_ptr, words, mask_w, X_BF16, True)
        chunk = w_full + offs_c * CW
        mask_g = mask_n[:, None] & (chunk < w_end)[None, :]
        scale = tl.load(s_ptr + s_rows + (chunk // (GROUP // 8))[None, :] * stride_sg, mask=mask_g, other=0.0)
        zero = tl.load(z_ptr + s_rows + (chunk // (GROUP // 8))[None, :] * stride_sg, mask=mask_g, other=0.0)
        acc += codes * scale.to(tl.float32) + x_sum[None, :] * zero.to(tl.float32)
    tl.store(out_ptr + pid_s * stride_os + offs_n, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _w4a16_tiled_kernel(
    # pointers
    x_ptr,  # [M, K]
    q_ptr,  # [N, K/2] uint8
    s_ptr, z_ptr,  # [N, groups] bfloat16
    y_ptr,  # [M, N]
    # sizes
    M, N, K,
    # strides
    stride_xm, stride_qn, stride_sn, stride_sg, stride_ym,
    # meta-parameters
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One program per [BLOCK_M, BLOCK_N] output tile, looping over K."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                    mask=mask_m[:, None] & (offs_k[None, :] < K), other=0.0)
        w = _dequant_tile(q_ptr, s_ptr, z_ptr, offs_n, k0, mask_n, K, stride_qn, stride_sn, stride_sg, GROUP, BLOCK_K)
        acc += tl.dot(x.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), input_precision=DOT_PRECISION)
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


# ---------------------------------------------------------------- launcher

def _check_args(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                group_size: int) -> tuple[int, int, int]:
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or x.stride(1) != 1:
        raise ValueError(f"x must be [M, K] float32/bfloat16/float16 with contiguous rows, got "
                         f"{tuple(x.shape)} {x.dtype}")
    m, k = x.shape
    n = qweight.shape[0]
    groups = -(-k // group_size)
    if qweight.dtype != torch.uint8 or tuple(qweight.shape) != (n, k // 2) or k % 2 or not qweight.is_contiguous():
        raise ValueError(f"qweight must be contiguous uint8 [N, {k // 2}] for K = {k} (even), got "
                         f"{tuple(qweight.shape)} {qweight.dtype}")
    for name, t in (("scales", scales), ("zeros", zeros)):
        if tuple(t.shape) != (n, groups) or not t.dtype.is_floating_point:
            raise ValueError(f"{name} must be float [{n}, {groups}] (group size {group_size}), got "
                             f"{tuple(t.shape)} {t.dtype}")
    if scales.stride() != zeros.stride():
        raise ValueError("scales and zeros must share strides")
    if group_size < 16 or group_size & (group_size - 1):
        raise ValueError(f"group_size must be a power of two >= 16, got {group_size}")
    if not (x.device == qweight.device == scales.device == zeros.device):
        raise ValueError("x, qweight, scales and zeros must be on one device")
    return m, n, k


class GemvTile(NamedTuple):
    """The GEMV path's launch: rows and packed bytes of a row a tile, warps, and the programs (N tiles times
    K ranges) below which K is split."""

    block_n: int
    block_b: int
    num_warps: int
    programs: int


def _words_fit(x: torch.Tensor, qweight: torch.Tensor) -> bool:
    """Whether the words forms of the GEMV can read these operands: one row, whole int32 words of codes (K a
    multiple of 8) from 4-byte aligned rows, and bfloat16 x in aligned pairs."""
    return (x.shape[0] == 1 and x.shape[1] % 8 == 0 and qweight.data_ptr() % 4 == 0
            and (x.dtype != torch.bfloat16 or x.data_ptr() % 4 == 0))


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


@functools.lru_cache(maxsize=1024)  # a model's few shapes: a dict lookup a call instead of ~3 us of Python
def gemv_tile(m: int, n: int, k: int, group_size: int, device: torch.device | None = None) -> GemvTile:
    """The GEMV path's default launch for x [m, K] (m <= GEMV_MAX_M) against an [n, k] weight. A program reads
    block_n x block_b packed bytes an iteration: enough bytes in flight per multiprocessor (a few KB) is what
    keeps a memory-bound GEMV near the read bandwidth; programs fill the multiprocessors four times over.
    From an H200 sweep at M = 1 (rows 8/16/32 x bytes 128/256/512 x warps 4/8, Llama-3-8B's projections, graph
    replays over weights past L2): 256 bytes and 4 warps were best or within 5% everywhere; 32 rows at g = 128
    (best on all three shapes), 16 at g = 32 (best on two, 12% off the best on the third). Rows for M > 1 are
    unmeasured."""
    sms = _multiprocessors(device or torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    block_b = min(256, max(16, triton.next_power_of_2(k // 2)))
    block_n = (32 if group_size >= 64 else 16) if m == 1 else 8
    return GemvTile(block_n=block_n, block_b=block_b, num_warps=4, programs=4 * sms)


def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               group_size: int, split_k: int | None = None, block_n: int | None = None,
               num_warps: int | None = None, block_b: int | None = None, kernel: str | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W.T in x's dtype, W the INT4 weight (layout above). `split_k`, `block_n` (rows a
    tile), `block_b` (packed bytes of a row a tile, a power of two), `num_warps` and `kernel` (the GEMV's form:
    one of `GEMV_KERNELS`, "bytes" by default; the words forms take M = 1, K a multiple of 8 and 4-byte aligned
    rows) override the GEMV path's choices (benchmarks sweep them; the other defaults are `gemv_tile`'s)."""
    m, n, k = _check_args(x, qweight, scales, zeros, group_size)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.zero_()
    block_k = min(64, group_size)  # divides the group: one scale per row per tile
    if m <= GEMV_MAX_M:
        tile = gemv_tile(m, n, k, group_size, x.device)
        block_n, block_b = block_n or tile.block_n, block_b or tile.block_b
        num_warps = num_warps or tile.num_warps
        if block_b < 1 or block_b & (block_b - 1):
            raise ValueError(f"block_b must be a power of two, got {block_b}")
        b_tiles = triton.cdiv(k // 2, block_b)
        n_tiles = triton.cdiv(n, block_n)
        if split_k is None:  # split K only where the N tiles alone leave the GPU's multiprocessors idle
            split_k = 1 if n_tiles >= tile.programs else max(1, min(b_tiles, triton.cdiv(tile.programs, n_tiles)))
        tiles_per_split = triton.cdiv(b_tiles, min(split_k, b_tiles))
        split_k = triton.cdiv(b_tiles, tiles_per_split)
        out = y if split_k == 1 else torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
        kernel = kernel or "bytes"  # the default until a GPU has timed the words forms (module doc)
        if kernel != "bytes":
            if kernel not in GEMV_KERNELS:
                raise ValueError(f"kernel must be one of {GEMV_KERNELS}, got {kernel!r}")
            if not _words_fit(x, qweight):
                raise ValueError(f"the {kernel} GEMV takes M = 1, K a multiple of 8 and 4-byte aligned rows")
            if block_b < 16:
                raise ValueError(f"the {kernel} GEMV reads at least 16 bytes a row a tile, got block_b {block_b}")
            _w4a16_gemv_words_kernel[(n_tiles, split_k)](
                x, qweight, scales, zeros, out, n, k, tiles_per_split * block_b,
                qweight.stride(0), scales.stride(0), scales.stride(1), out.stride(0) if split_k > 1 else 0,
                GROUP=group_size, BLOCK_N=block_n, BLOCK_B=block_b, PREFETCH=kernel == "words-prefetch",
                num_warps=num_warps)
            return y if split_k == 1 else out.sum(0).to(x.dtype)
        _w4a16_gemv_kernel[(n_tiles, split_k)](
            x, qweight, scales, zeros, out,
            m, n, k, tiles_per_split * block_b,
            x.stride(0), qweight.stride(0), scales.stride(0), scales.stride(1),
            out.stride(0) if split_k > 1 else 0, out.stride(-2),
            GROUP=group_size, BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_B=block_b,
            HALF_G=min(group_size // 2, block_b), num_warps=num_warps,
        )
        return y if split_k == 1 else out.sum(0).to(x.dtype)
    dot_dtype = _dot_dtype(x.dtype) if x.dtype != torch.float16 else tl.float16
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, 64))
    _w4a16_tiled_kernel[grid](
        x, qweight, scales, zeros, y,
        m, n, k,
        x.stride(0), qweight.stride(0), scales.stride(0), scales.stride(1), y.stride(0),
        GROUP=group_size, BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=block_k,
        DOT_DTYPE=dot_dtype, DOT_PRECISION="ieee" if dot_dtype == tl.float32 else None,  # no TF32
    )
    return y


# ---------------------------------------------------------------- torch reference and the format itself

def unpack_int4_ref(qweight: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> codes int32 [N, K] in 0..15 (low nibble first)."""
    low = (qweight & 0xF).to(torch.int32)
    high = (qweight >> 4).to(torch.int32)
    return torch.stack([low, high], dim=-1).view(qweight.shape[0], -1)


def dequantize_int4_ref(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                        in_features: int | None = None) -> torch.Tensor:
    """The float32 weight [N, K] an INT4 weight stands for."""
    codes = unpack_int4_ref(qweight)
    k = in_features if in_features is not None else codes.shape[1]
    s = scales.float().repeat_interleave(group_size, dim=1)[:, :k]
    z = zeros.float().repeat_interleave(group_size, dim=1)[:, :k]
    return (codes[:, :k] - 8).float() * s + z


def quantize_int4_ref(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float [N, K] (K even) -> (qweight uint8 [N, K/2], scales, zeros bfloat16 [N, ceil(K/g)])."""
    n, k = w.shape
    groups = -(-k // group_size)
    wf = w.float()
    pad = groups * group_size - k
    lo = torch.nn.functional.pad(wf, (0, pad), value=float("inf")).view(n, groups, group_size).amin(-1)
    hi = torch.nn.functional.pad(wf, (0, pad), value=float("-inf")).view(n, groups, group_size).amax(-1)
    flat = hi == lo  # a constant group: code 8 stands for the value itself
    scales = torch.where(flat, 1.0, div_exact(hi - lo, 15.0)).to(torch.bfloat16)  # alike on every device
    zeros = torch.where(flat, lo, lo + 8 * scales.float()).to(torch.bfloat16)
    s = scales.float().repeat_interleave(group_size, dim=1)[:, :k]
    z = zeros.float().repeat_interleave(group_size, dim=1)[:, :k]
    codes = (torch.round((wf - z) / s) + 8).clamp(0, 15).to(torch.uint8)  # [N, K]
    qweight = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return qweight.contiguous(), scales, zeros


def w4a16_gemm_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                   group_size: int) -> torch.Tensor:
    """Plain-torch `w4a16_gemm`: dequantise, then one float32 GEMM; returns x's dtype."""
    w = dequantize_int4_ref(qweight, scales, zeros, group_size, x.shape[1])
    return (x.float() @ w.t()).to(x.dtype)
