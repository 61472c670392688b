"""Paged decode attention: one query token per sequence over FP8 or BF16 KV pages.

Pages are in the format documented in `kernels/kv_store.py` (FP8 e4m3 values with
one int8 power-of-two exponent per (token, kv head), or plain float values).

Work split, for q [B, num_heads, head_dim] against a cache of num_kv_heads heads:
- GQA: the G = num_heads / num_kv_heads query heads that share a KV head are one
  program's G query rows (padded to BLOCK_G >= 16 for `tl.dot`), so each K/V tile
  is loaded once for all G heads. Query head h reads KV head h // G.
- Split-KV: each sequence's context is cut into `num_splits` contiguous partitions
  of whole BLOCK_N-token tiles, one program each: grid (B, num_kv_heads, num_splits).
  A partition yields its normalised partial output and log-sum-exp (base 2); a
  second small kernel merges them: out = sum_s 2**(lse_s - m) o_s / sum_s 2**(lse_s - m).
  `num_splits=None` picks it from the batch shape (`default_num_splits`): enough
  programs to fill the GPU twice, partitions of at least 256 tokens.
  With one split the first kernel writes the output directly.
- Tiles gather tokens through the page table, so pages may be in any order and
  page-table entries past a sequence's last page are never read.

FP8 dequantisation happens in the kernel and costs no pass over the tile: since
the scale is one power of two per key, q . (k * 2**e_k) = (q . k) * 2**e_k and
p @ (v * 2**e_v) = (p * 2**e_v) @ v, both exact in floating point, so the
exponents scale the [G, BLOCK_N] scores and probabilities instead of the
[BLOCK_N, head_dim] tiles. The fp8 -> q.dtype conversion itself is exact.

Compute dtype is q's dtype: float32 q runs both dots in IEEE float32 (no TF32);
bfloat16 q runs them in bfloat16 with float32 accumulation, casting the softmax
probabilities to bfloat16 as flash attention does. Over FP8 pages bfloat16 q runs both
dots in float16 instead (`fp16_dots`): e4m3 -> float16 is one hardware conversion for
two values, where e4m3 -> bfloat16 goes through float32 (on an H200, batch 64 x 4096
tokens: 281 against 305 us at each one's best tile, 47% against 43% of the read
bandwidth; the tile, not the conversion, is most of FP8's gap to BF16's 101%). Every
e4m3 value is exact in float16; q is clamped to float16's range (a no-op for real
queries; bfloat16 -> float16 keeps more mantissa); the probabilities are scaled by
2**(e_v - e_max) <= 1, e_max the tile's largest V exponent, and the tile's p @ v by
2**e_max after the dot, so they never leave float16's range, with 3 more mantissa bits
than bfloat16 probabilities. The softmax runs in float32 in the log2 domain (exp2 with
1/ln 2 folded into the score scale).

**V in pairs** (`v_pairs`, with float16 dots; opt-in until a GPU has timed it): the V tile enters
p @ v as the dot's second operand, whose threads hold pairs of consecutive *tokens* for one
dimension, 128 bytes apart in the page rows. Triton moves the tile into that layout before
converting it (on the FP8 bytes, to keep shared memory small), and with no transposing load for
8-bit data it reads the tile one byte at a time: compiled for sm_90 (`edgeserve bench sass`), 128
one-byte shared-memory loads a thread per 128-token tile, 255 registers with spills, 8 resident
warps a multiprocessor. With `v_pairs` V is loaded as int16 pairs of dimensions and made float16
in registers first (`cvt.rn.f16x2.e4m3x2`, one instruction for two values; under the interpreter
the same bits by integer operations: e4m3's s eeee mmm placed at float16's bits 15 and 13..7 is
the value times 2**-8, for subnormals too), so the layout change moves 16-bit values: no byte
loads, 146 registers, no spills, 12 resident warps, 3.84 instructions a KV byte against 4.64.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.kv_store import check_cache_args, dequantize_fp8_ref, exp2_int

__all__ = ["paged_decode_attention", "paged_decode_attention_ref", "default_num_splits", "merge_splits"]

MIN_TOKENS_PER_SPLIT = 256  # below this a partition's fixed cost outweighs the extra parallelism
MAX_SPLITS = 32
# FP8 pages' split-kernel tile: tokens, warps, pipeline stages. An H200 sweep at batch 64 x 4096 tokens
# (Llama-3-8B's heads; tokens 64/128 x warps 4/8 x stages 2/4): 128 tokens, 4 warps, 4 stages read 47% of the
# read bandwidth where the 64-token tile of BF16 pages (their best, 101%) gave FP8 pages 28%
FP8_TILE = (128, 4, 4)


# ---------------------------------------------------------------- kernels

@triton.jit
def _e4m3_pairs_to_fp16(pairs, ASM: tl.constexpr):
    """int16 [N, D/2], e4m3 values of dimensions 2j (low byte) and 2j + 1 (high byte) -> float16 [N, D], exactly
    (module doc; e4m3's NaN code becomes NaN with ASM, 480 without: pages never hold it)."""
    if ASM:
        both = tl.inline_asm_elementwise("cvt.rn.f16x2.e4m3x2 $0, $1;", "=r,h", [pairs], dtype=tl.int32,
                                         is_pure=True, pack=1)
        low = (both & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
        high = (both >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    else:
        b = pairs.to(tl.int32)
        lo, hi = b & 0xFF, (b >> 8) & 0xFF
        low = (((lo & 0x80) << 8) | ((lo & 0x7F) << 7)).to(tl.int16).to(tl.float16, bitcast=True) * 256.0
        high = (((hi & 0x80) << 8) | ((hi & 0x7F) << 7)).to(tl.int16).to(tl.float16, bitcast=True) * 256.0
    return tl.reshape(tl.join(low, high), [pairs.shape[0], 2 * pairs.shape[1]])


@triton.jit
def _paged_decode_split_kernel(
    # pointers
    q_ptr,  # [B, num_heads, head_dim]
    k_cache_ptr, v_cache_ptr,  # [num_pages, PAGE_SIZE, num_kv_heads, head_dim]
    k_scale_ptr, v_scale_ptr,  # [num_pages, PAGE_SIZE, num_kv_heads] int8 (FP8 only)
    page_table_ptr,  # [B, max_pages] int32
    context_lens_ptr,  # [B] int32
    out_ptr,  # [B, num_heads, num_splits, head_dim]: partial outputs (or the output itself when 1 split)
    lse_ptr,  # [B, num_heads, num_splits] float32, log2-sum-exp2 of each partition's scores
    # scalars
    qk_scale,  # softmax scale * 1/ln 2
    num_splits,
    # strides
    stride_qb, stride_qh,
    stride_cp, stride_ct, stride_ch,  # K and V caches share strides
    stride_sp, stride_st, stride_sh,  # K and V scales share strides
    stride_ptb,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh, stride_ls,
    # meta-parameters
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_FP8: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, FP16_DOTS: tl.constexpr,
    V_PAIRS: tl.constexpr = False, V_ASM: tl.constexpr = False,
):
    """One program per (sequence, kv head, partition): the GROUP query heads of that kv head
    over the partition's tokens, with a running softmax (m_i, l_i, acc) in the log2 domain."""
    pid_b = tl.program_id(0)
    pid_kvh = tl.program_id(1)
    pid_s = tl.program_id(2)

    context_len = tl.load(context_lens_ptr + pid_b)
    # this partition's tokens [split_start, split_end), whole tiles except the last
    split_len = tl.cdiv(tl.cdiv(context_len, num_splits), BLOCK_N) * BLOCK_N
    split_start = pid_s * split_len
    split_end = tl.minimum(split_start + split_len, context_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = pid_kvh * GROUP + offs_g  # the query heads reading this KV head

    q_ptrs = q_ptr + pid_b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_g[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
    if FP16_DOTS:  # FP8 pages (module doc): q clamped into float16's range, a no-op for any real query
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    else:
        q = q.to(DOT_DTYPE)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    page_table_row = page_table_ptr + pid_b.to(tl.int64) * stride_ptb
    for start in range(split_start, split_end, BLOCK_N):
        offs_t = start + offs_n  # token positions in the sequence
        mask_t = offs_t < split_end
        page = tl.load(page_table_row + offs_t // PAGE_SIZE, mask=mask_t, other=0).to(tl.int64)
        slot_in_page = offs_t % PAGE_SIZE
        rows = page * stride_cp + slot_in_page * stride_ct + pid_kvh * stride_ch  # [BLOCK_N] int64
        mask_kv = mask_t[:, None] & mask_d[None, :]
        k = tl.load(k_cache_ptr + rows[:, None] + offs_d[None, :], mask=mask_kv, other=0.0)
        if V_PAIRS:  # float16 [BLOCK_N, BLOCK_D] from int16 pairs of FP8 values (module doc)
            offs_h = tl.arange(0, BLOCK_D // 2)
            pairs = tl.load(v_cache_ptr.to(tl.pointer_type(tl.int16)) + rows[:, None] // 2 + offs_h[None, :],
                            mask=mask_t[:, None] & (offs_h[None, :] < HEAD_DIM // 2), other=0)
            v = _e4m3_pairs_to_fp16(pairs, V_ASM)
        else:
            v = tl.load(v_cache_ptr + rows[:, None] + offs_d[None, :], mask=mask_kv, other=0.0)

        if FP16_DOTS:
            s = tl.dot(q, tl.trans(k.to(tl.float16)))  # [BLOCK_G, BLOCK_N] float32
        else:
            s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION)
        if IS_FP8:
            scale_rows = page * stride_sp + slot_in_page * stride_st + pid_kvh * stride_sh
            k_exp = tl.load(k_scale_ptr + scale_rows, mask=mask_t, other=0)
            v_exp = tl.load(v_scale_ptr + scale_rows, mask=mask_t, other=-126).to(tl.int32)
            s = s * exp2_int(k_exp)[None, :]
        s = tl.where(mask_t[None, :], s * qk_scale, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if FP16_DOTS:  # the tile's largest V exponent leaves the dot: p 2**(e_v - e_max) <= 1 stays in range
            e_max = tl.max(v_exp, axis=0)
            p = p * exp2_int(tl.maximum(v_exp - e_max, -126))[None, :]
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v.to(tl.float16)) * exp2_int(e_max)
        else:
            if IS_FP8:
                p = p * exp2_int(v_exp)[None, :]
            acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        m_i = m_new

    # an empty partition (short sequence, many splits) leaves l_i == 0: output 0, lse -inf
    nonempty = l_i > 0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    out_ptrs = out_ptr + pid_b * stride_ob + heads[:, None] * stride_oh + pid_s * stride_os + offs_d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])
    tl.store(lse_ptr + pid_b * stride_lb + heads * stride_lh + pid_s * stride_ls, lse, mask=mask_g)


@triton.jit
def _merge_splits_kernel(
    # pointers
    part_ptr,  # [B, num_heads, num_splits, DIM] float32
    lse_ptr,  # [B, num_heads, num_splits] float32
    out_ptr,  # [B, num_heads, DIM]
    # scalars
    num_splits,
    # strides
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    stride_ob, stride_oh,
    # meta-parameters
    DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program per (sequence, query head): LSE-weighted sum of the partial outputs."""
    pid_b = tl.program_id(0)
    pid_h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    mask_d = offs_d < DIM
    lse = tl.load(lse_ptr + pid_b * stride_lb + pid_h * stride_lh + offs_s, mask=mask_s, other=float("-inf"))
    weights = tl.exp2(lse - tl.max(lse, axis=0))  # [BLOCK_S]; empty partitions weigh 0
    part_ptrs = part_ptr + pid_b * stride_pb + pid_h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :]
    part = tl.load(part_ptrs, mask=mask_s[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_S, BLOCK_D]
    out = tl.sum(weights[:, None] * part, axis=0) / tl.sum(weights, axis=0)
    tl.store(out_ptr + pid_b * stride_ob + pid_h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=mask_d)


# ---------------------------------------------------------------- launcher

def merge_splits(partial: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, block_d: int,
                 num_warps: int = 4) -> None:
    """Writes into `out` [B, H, D] the split-K decode's partitions merged: `partial` [B, H, splits, D] float32 weighted
    by `lse` [B, H, splits] (log2 of each partition's softmax sum, -inf where a partition was empty). `block_d` is
    the D tile (a power of two >= D) the split kernel used. Shared by the GQA and the MLA (latent) decodes."""
    batch, num_heads, num_splits, dim = partial.shape
    _merge_splits_kernel[(batch, num_heads)](
        partial, lse, out, num_splits,
        partial.stride(0), partial.stride(1), partial.stride(2),
        lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        DIM=dim, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d, num_warps=num_warps,
    )


def default_num_splits(batch: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Partitions per sequence: enough programs to fill the GPU about twice over, but no
    partition shorter than MIN_TOKENS_PER_SPLIT tokens of the longest context.

    `max_context` is the page table's width times PAGE_SIZE (an upper bound known without
    reading context_lens back from the device, so the choice never synchronises).
    """
    cuda = device.type == "cuda"
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 132  # an H100/H200
    by_occupancy = triton.cdiv(2 * num_sms, batch * num_kv_heads)
    by_length = triton.cdiv(max_context, MIN_TOKENS_PER_SPLIT)
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


def _dot_dtype(q_dtype: torch.dtype) -> tl.dtype:
    """Operand dtype of both dots: q's dtype, except float32 under the Triton interpreter,
    whose tl.dot multiplies bfloat16 operands as raw 16-bit integers (triton 3.9)."""
    return tl.float32 if q_dtype == torch.float32 or triton.knobs.runtime.interpret else tl.bfloat16


def _check_attention_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                          page_table: torch.Tensor, context_lens: torch.Tensor) -> bool:
    is_fp8 = check_cache_args(k_cache, v_cache, k_scale, v_scale)
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if q.dtype not in (torch.float32, torch.bfloat16) or q.stride(-1) != 1:
        raise ValueError(f"q must be float32 or bfloat16 with a contiguous head_dim, got {q.dtype}")
    if head_dim != k_cache.shape[3] or num_heads % num_kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit a cache of {num_kv_heads} kv heads x {k_cache.shape[3]}")
    if page_table.dim() != 2 or page_table.shape[0] != batch or page_table.dtype != torch.int32 \
            or page_table.stride(-1) != 1:
        raise ValueError(f"page_table must be [{batch}, max_pages] int32 with contiguous rows, "
                         f"got {tuple(page_table.shape)} {page_table.dtype}")
    if context_lens.shape != (batch,) or context_lens.dtype != torch.int32 or not context_lens.is_contiguous():
        raise ValueError(f"context_lens must be [{batch}] int32, got {tuple(context_lens.shape)} {context_lens.dtype}")
    if not (q.device == page_table.device == context_lens.device == k_cache.device):
        raise ValueError("q, page_table, context_lens and the cache must be on one device")
    return is_fp8


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                           page_table: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           num_splits: int | None = None, block_n: int | None = None, num_warps: int | None = None,
                           num_stages: int | None = None, fp16_dots: bool | None = None,
                           v_pairs: bool = False) -> torch.Tensor:
    """Attention of q [B, heads, head_dim] over each sequence's first context_lens[b] (>= 1)
    cached tokens, reached through page_table [B, max_pages]; returns [B, heads, head_dim] in q's dtype.
    `block_n` (tokens a tile, a power of two >= 16), `num_warps` and `num_stages` tune the split kernel
    (benchmarks sweep them; where None: `FP8_TILE` over FP8 pages, else 64 tokens and Triton's defaults).
    `fp16_dots` (FP8 pages with bfloat16 q only; the default there) runs both dots on float16 operands, and
    `v_pairs` (with them, an even head_dim) reads V in pairs made float16 before its dot (module doc)."""
    is_fp8 = _check_attention_args(q, k_cache, v_cache, k_scale, v_scale, page_table, context_lens)
    batch, num_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    if num_splits is None:
        num_splits = default_num_splits(batch, num_kv_heads, page_table.shape[1] * page_size, q.device)
    if is_fp8:
        block_n, num_warps, num_stages = (block_n or FP8_TILE[0], num_warps or FP8_TILE[1],
                                          num_stages or FP8_TILE[2])
    block_n = block_n or 64
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    tuning = {k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages)) if v is not None}
    out = torch.empty_like(q)
    if batch == 0:
        return out
    if num_splits == 1:  # the partition is the whole context: write the output directly
        partial = out.unsqueeze(2)  # [B, heads, 1, head_dim]
    else:
        partial = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    if not is_fp8:  # placeholders for the unused pointer arguments
        k_scale = v_scale = context_lens
    scale_strides = k_scale.stride() if is_fp8 else (0, 0, 0)
    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs every dim >= 16
    dot_dtype = _dot_dtype(q.dtype)
    if fp16_dots is None:
        fp16_dots = is_fp8 and q.dtype == torch.bfloat16
    if fp16_dots and not (is_fp8 and q.dtype == torch.bfloat16):
        raise ValueError("fp16_dots is for FP8 pages with bfloat16 queries")
    if v_pairs and not (fp16_dots and head_dim % 2 == 0 and v_cache.data_ptr() % 2 == 0):
        raise ValueError("v_pairs takes FP8 pages with float16 dots, an even head_dim and 2-byte aligned V pages")
    _paged_decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, k_scale, v_scale, page_table, context_lens, partial, lse,
        scale * 1.44269504, num_splits,  # 1/ln 2: the softmax runs on exp2
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        *scale_strides,
        page_table.stride(0),
        partial.stride(0), partial.stride(1), partial.stride(2),
        lse.stride(0), lse.stride(1), lse.stride(2),
        GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d,
        BLOCK_N=block_n,  # tokens per tile (64: 4 pages of 16; FP8_TILE's over FP8 pages), any page size
        IS_FP8=is_fp8, DOT_DTYPE=dot_dtype, DOT_PRECISION="ieee" if dot_dtype == tl.float32 else None,  # no TF32
        FP16_DOTS=fp16_dots, V_PAIRS=v_pairs,
        V_ASM=v_pairs and q.is_cuda and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), **tuning,
    )
    if num_splits > 1:
        merge_splits(partial, lse, out, block_d)
    return out


# ---------------------------------------------------------------- torch reference

def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                               page_table: torch.Tensor, context_lens: torch.Tensor, scale: float,
                               num_splits: int | None = None) -> torch.Tensor:
    """Plain-torch `paged_decode_attention`, one sequence at a time in float32 (num_splits is ignored)."""
    is_fp8 = _check_attention_args(q, k_cache, v_cache, k_scale, v_scale, page_table, context_lens)
    batch, num_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    for b in range(batch):
        positions = torch.arange(int(context_lens[b]), device=q.device)
        pages = page_table[b, positions // page_size].long()
        offsets = positions % page_size
        if is_fp8:
            # [L, kv_heads, head_dim]; indexing float8 is not implemented on CPU: gather the bytes
            k = dequantize_fp8_ref(k_cache.view(torch.uint8)[pages, offsets], k_scale[pages, offsets])
            v = dequantize_fp8_ref(v_cache.view(torch.uint8)[pages, offsets], v_scale[pages, offsets])
        else:
            k, v = k_cache[pages, offsets].float(), v_cache[pages, offsets].float()
        # query head h reads kv head h // G
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1).transpose(0, 1)  # [heads, L, head_dim]
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1).transpose(0, 1)
        scores = (q[b].float().unsqueeze(1) @ k.transpose(1, 2)).squeeze(1) * scale  # [heads, L]
        out[b] = (torch.softmax(scores, dim=-1).unsqueeze(1) @ v).squeeze(1).to(q.dtype)
    return out
