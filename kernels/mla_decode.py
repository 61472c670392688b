"""MLA decode attention: absorbed queries over paged latent KV rows (one latent KV head).

Rows are in the format of `kernels/latent_kv_store.py`: per token [c_kv (R) | k_pe (Dr)]
in float32 / bfloat16, or fp8_e4m3 bytes [R e4m3 | ceil(R/128) float32 scales | Dr bf16].

In absorbed MLA decode every query head h attends over the same latent rows:

    s[h, n] = scale * (q_latent[h] . c_kv[n] + q_pe[h] . k_pe[n])
    out[h]  = softmax_n(s[h]) @ c_kv                       (out: [H, R]; W_UV is applied after)

so K and V are the same tile (c_kv) and there is no per-head KV at all.

Work split, for D sequences, H query heads:
- BLOCK_H query heads per program (>= 16 for `tl.dot`): each latent tile is loaded once
  and used by all BLOCK_H heads, for both dots (scores and output).
- Split-KV: each sequence's context is cut into `num_kv_splits` contiguous partitions of
  whole BLOCK_N-token tiles, one program each: grid (D, cdiv(H, BLOCK_H), num_kv_splits).
  A partition writes its normalised partial output [BLOCK_H, R] (float32) and its
  log-sum-exp (base 2); a second kernel (`merge_splits`, shared with the GQA decode in
  `kernels/paged_attention.py`) merges the partitions of each (sequence, head):
  out = sum_s 2**(lse_s - m) o_s / sum_s 2**(lse_s - m), m = max_s lse_s. A partition past a
  short sequence's end is empty: it writes lse = -inf and weighs 0 in the merge.
- Tiles gather tokens through the page table, so pages may be in any order or shared
  between sequences, and page-table entries past a sequence's last page are never read.

FP8 rows are dequantised in registers: the e4m3 latent tile is converted to float32 and
multiplied by its group's scale (a gathered load of the row's float32 scales, one per 128
columns), then cast to the dot dtype; the rope tail is read as bfloat16. Unlike the GQA
cache's power-of-two scales, a group scale cannot be pulled out of the [BLOCK_H, BLOCK_N]
scores, as it changes along the reduced dimension.

Compute dtype is q's dtype: float32 q runs both dots in IEEE float32 (no TF32); bfloat16
q runs them in bfloat16 with float32 accumulation (dequantised fp8 latents are rounded to
bfloat16 first, and the softmax probabilities too, as flash attention does). Under the
Triton interpreter the dots always run in float32 (its bfloat16 dot is wrong, see
`kernels/paged_attention.py`). The softmax runs in float32 in the log2 domain (exp2 with
1/ln 2 folded into the score scale). Sequences need context_lens[d] >= 1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backend.errors import InvalidRequest
from kernels.latent_kv_store import FP8_GROUP, dequantize_latent_ref, latent_row_dtype, latent_row_elems
from kernels.paged_attention import _dot_dtype, default_num_splits, merge_splits

__all__ = ["mla_decode_attention", "mla_decode_ref", "BLOCK_H"]

BLOCK_H = 16  # query heads per program: the smallest tl.dot M; [16, 512] float32 accumulators fit in registers
BLOCK_N = 32  # tokens per tile (any page size)


# ---------------------------------------------------------------- kernels

@triton.jit
def _mla_decode_split_kernel(
    # pointers
    q_latent_ptr,  # [D, H, R]
    q_pe_ptr,  # [D, H, Dr]
    rows_ptr,  # [num_pages, PAGE_SIZE, row_elems] float32 / bfloat16 (plain formats)
    fp8_ptr, scale_ptr, rope_ptr,  # fp8 pages viewed as float8_e4m3fn, float32, bfloat16
    page_table_ptr,  # [D, max_pages] int32
    context_lens_ptr,  # [D] int32
    out_ptr,  # [D, H, num_splits, R] float32 partial outputs (the output itself when 1 split)
    lse_ptr,  # [D, H, num_splits] float32, log2-sum-exp2 of each partition's scores
    # scalars
    qk_scale,  # softmax scale * 1/ln 2
    num_splits,
    # strides
    stride_qlb, stride_qlh, stride_qpb, stride_qph,
    stride_rp, stride_rt,  # pages, in elements of rows_ptr (bytes for fp8)
    stride_ptb,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh, stride_ls,
    # meta-parameters
    NUM_HEADS: tl.constexpr, KV_LORA_RANK: tl.constexpr, ROPE_DIM: tl.constexpr, NUM_GROUPS: tl.constexpr,
    GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_FP8: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One program per (sequence, head block, partition): BLOCK_H heads over the partition's
    tokens, with a running softmax (m_i, l_i, acc) in the log2 domain."""
    pid_b = tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_s = tl.program_id(2)

    context_len = tl.load(context_lens_ptr + pid_b)
    # this partition's tokens [split_start, split_end), whole tiles except the last
    split_len = tl.cdiv(tl.cdiv(context_len, num_splits), BLOCK_N) * BLOCK_N
    split_start = pid_s * split_len
    split_end = tl.minimum(split_start + split_len, context_len)

    heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, BLOCK_R)
    offs_dr = tl.arange(0, BLOCK_DR)
    offs_n = tl.arange(0, BLOCK_N)
    mask_h = heads < NUM_HEADS
    mask_r = offs_r < KV_LORA_RANK
    mask_dr = offs_dr < ROPE_DIM

    q_lat_ptrs = q_latent_ptr + pid_b * stride_qlb + heads[:, None] * stride_qlh + offs_r[None, :]
    q_lat = tl.load(q_lat_ptrs, mask=mask_h[:, None] & mask_r[None, :], other=0.0).to(DOT_DTYPE)  # [BLOCK_H, BLOCK_R]
    q_pe_ptrs = q_pe_ptr + pid_b * stride_qpb + heads[:, None] * stride_qph + offs_dr[None, :]
    q_pe = tl.load(q_pe_ptrs, mask=mask_h[:, None] & mask_dr[None, :], other=0.0).to(DOT_DTYPE)  # [BLOCK_H, BLOCK_DR]

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    page_table_row = page_table_ptr + pid_b.to(tl.int64) * stride_ptb
    for start in range(split_start, split_end, BLOCK_N):
        offs_t = start + offs_n  # token positions in the sequence
        mask_t = offs_t < split_end
        page = tl.load(page_table_row + offs_t // PAGE_SIZE, mask=mask_t, other=0).to(tl.int64)
        row_off = page * stride_rp + (offs_t % PAGE_SIZE) * stride_rt  # [BLOCK_N] int64
        mask_c = mask_t[:, None] & mask_r[None, :]
        mask_pe = mask_t[:, None] & mask_dr[None, :]
        if IS_FP8:
            c = tl.load(fp8_ptr + row_off[:, None] + offs_r[None, :], mask=mask_c, other=0.0).to(tl.float32)
            scale_ptrs = scale_ptr + (row_off // 4 + KV_LORA_RANK // 4)[:, None] + (offs_r // GROUP)[None, :]
            c = c * tl.load(scale_ptrs, mask=mask_c, other=0.0)  # each column's group scale
            rope_off = row_off // 2 + (KV_LORA_RANK + 4 * NUM_GROUPS) // 2
            k_pe = tl.load(rope_ptr + rope_off[:, None] + offs_dr[None, :], mask=mask_pe, other=0.0)
        else:
            c = tl.load(rows_ptr + row_off[:, None] + offs_r[None, :], mask=mask_c, other=0.0)
            k_pe = tl.load(rows_ptr + row_off[:, None] + KV_LORA_RANK + offs_dr[None, :], mask=mask_pe, other=0.0)
        c = c.to(DOT_DTYPE)  # [BLOCK_N, BLOCK_R]: the keys' latent part and the values

        s = tl.dot(q_lat, tl.trans(c), input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_N] float32
        s += tl.dot(q_pe, tl.trans(k_pe.to(DOT_DTYPE)), input_precision=DOT_PRECISION)
        s = tl.where(mask_t[None, :], s * qk_scale, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), c, input_precision=DOT_PRECISION)
        m_i = m_new

    # an empty partition (short sequence, many splits) leaves l_i == 0: output 0, lse -inf
    nonempty = l_i > 0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    out_ptrs = out_ptr + pid_b * stride_ob + heads[:, None] * stride_oh + pid_s * stride_os + offs_r[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_h[:, None] & mask_r[None, :])
    tl.store(lse_ptr + pid_b * stride_lb + heads * stride_lh + pid_s * stride_ls, lse, mask=mask_h)


# ---------------------------------------------------------------- launcher

def _check_decode_args(q_latent: torch.Tensor, q_pe: torch.Tensor, pages_layer: torch.Tensor, kv_format: str,
                       kv_lora_rank: int, rope_dim: int, page_table: torch.Tensor,
                       context_lens: torch.Tensor) -> None:
    """Validate shapes, dtypes and devices against the latent row format (InvalidRequest otherwise)."""
    row_elems = latent_row_elems(kv_lora_rank, rope_dim, kv_format)
    if q_latent.dim() != 3 or q_latent.shape[2] != kv_lora_rank or q_pe.shape != (*q_latent.shape[:2], rope_dim):
        raise InvalidRequest(f"q_latent, q_pe must be [D, H, {kv_lora_rank}], [D, H, {rope_dim}], "
                             f"got {tuple(q_latent.shape)}, {tuple(q_pe.shape)}")
    if q_latent.dtype not in (torch.float32, torch.bfloat16) or q_pe.dtype != q_latent.dtype \
            or q_latent.stride(-1) != 1 or q_pe.stride(-1) != 1:
        raise InvalidRequest(f"q_latent and q_pe must be one of float32 / bfloat16 with a contiguous last dim, "
                             f"got {q_latent.dtype}, {q_pe.dtype}")
    if pages_layer.dim() != 3 or pages_layer.shape[2] != row_elems or pages_layer.stride(2) != 1 \
            or pages_layer.dtype != latent_row_dtype(kv_format):
        raise InvalidRequest(f"{kv_format} pages must be [num_pages, page_size, {row_elems}] "
                             f"{latent_row_dtype(kv_format)}, got {tuple(pages_layer.shape)} {pages_layer.dtype}")
    batch = q_latent.shape[0]
    if page_table.dim() != 2 or page_table.shape[0] != batch or page_table.dtype != torch.int32 \
            or page_table.stride(-1) != 1:
        raise InvalidRequest(f"page_table must be [{batch}, max_pages] int32 with contiguous rows, "
                             f"got {tuple(page_table.shape)} {page_table.dtype}")
    if context_lens.shape != (batch,) or context_lens.dtype != torch.int32 or not context_lens.is_contiguous():
        raise InvalidRequest(f"context_lens must be [{batch}] int32, got {tuple(context_lens.shape)} "
                             f"{context_lens.dtype}")
    if not (q_latent.device == q_pe.device == pages_layer.device == page_table.device == context_lens.device):
        raise InvalidRequest("queries, pages, page_table and context_lens must be on one device")


def mla_decode_attention(q_latent: torch.Tensor, q_pe: torch.Tensor, pages_layer: torch.Tensor, kv_format: str,
                         kv_lora_rank: int, rope_dim: int, page_table: torch.Tensor, context_lens: torch.Tensor,
                         scale: float, num_kv_splits: int | None = None) -> torch.Tensor:
    """softmax(scale * (q_latent . c_kv + q_pe . k_pe)) @ c_kv for q_latent [D, H, R], q_pe [D, H, Dr] over each
    sequence's first context_lens[d] (>= 1) rows, reached through page_table [D, max_pages] (int32) in
    pages_layer [num_pages, page_size, row_elems]; returns out_latent [D, H, R] in q's dtype (Triton).
    `num_kv_splits` None: enough partitions to fill the device (`default_num_splits`, as the GQA
    kernel chooses, with the head blocks in the place of KV heads), never a partition under
    MIN_TOKENS_PER_SPLIT tokens of the page table's width."""
    _check_decode_args(q_latent, q_pe, pages_layer, kv_format, kv_lora_rank, rope_dim, page_table, context_lens)
    if num_kv_splits is None:
        num_kv_splits = default_num_splits(q_latent.shape[0], triton.cdiv(q_latent.shape[1], BLOCK_H),
                                           page_table.shape[1] * pages_layer.shape[1], q_latent.device)
    if num_kv_splits < 1:
        raise InvalidRequest(f"num_kv_splits must be >= 1, got {num_kv_splits}")
    batch, num_heads, _ = q_latent.shape
    out = torch.empty_like(q_latent)
    if batch == 0 or num_heads == 0:
        return out
    if num_kv_splits == 1:  # the partition is the whole context: write the output directly
        partial = out.unsqueeze(2)  # [D, H, 1, R]
    else:
        partial = torch.empty(batch, num_heads, num_kv_splits, kv_lora_rank, dtype=torch.float32,
                              device=q_latent.device)
    lse = torch.empty(batch, num_heads, num_kv_splits, dtype=torch.float32, device=q_latent.device)
    is_fp8 = kv_format == "fp8_e4m3"
    if is_fp8:  # the row's three parts as typed views of the same bytes (row_bytes % 4 == 0)
        if pages_layer.stride(0) % 4 or pages_layer.stride(1) % 4 or pages_layer.storage_offset() % 4:
            raise InvalidRequest("fp8 latent pages need 4-byte aligned rows")
        views = tuple(pages_layer.view(dtype) for dtype in (torch.float8_e4m3fn, torch.float32, torch.bfloat16))
    else:
        views = (pages_layer, pages_layer, pages_layer)  # placeholders for the unused fp8 pointers
    block_r = max(16, triton.next_power_of_2(kv_lora_rank))  # tl.dot needs every dim >= 16
    dot_dtype = _dot_dtype(q_latent.dtype)
    _mla_decode_split_kernel[(batch, triton.cdiv(num_heads, BLOCK_H), num_kv_splits)](
        q_latent, q_pe, pages_layer, *views, page_table, context_lens, partial, lse,
        scale * 1.44269504, num_kv_splits,  # 1/ln 2: the softmax runs on exp2
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1),
        pages_layer.stride(0), pages_layer.stride(1),
        page_table.stride(0),
        partial.stride(0), partial.stride(1), partial.stride(2),
        lse.stride(0), lse.stride(1), lse.stride(2),
        NUM_HEADS=num_heads, KV_LORA_RANK=kv_lora_rank, ROPE_DIM=rope_dim,
        NUM_GROUPS=triton.cdiv(kv_lora_rank, FP8_GROUP), GROUP=FP8_GROUP, PAGE_SIZE=pages_layer.shape[1],
        BLOCK_H=BLOCK_H, BLOCK_R=block_r, BLOCK_DR=max(16, triton.next_power_of_2(rope_dim)), BLOCK_N=BLOCK_N,
        IS_FP8=is_fp8, DOT_DTYPE=dot_dtype, DOT_PRECISION="ieee" if dot_dtype == tl.float32 else None,  # no TF32
        num_warps=8 if block_r >= 256 else 4,  # [BLOCK_H, R] accumulators and [BLOCK_N, R] tiles: spread them
    )
    if num_kv_splits > 1:
        merge_splits(partial, lse, out, block_r, num_warps=8 if block_r >= 256 else 4)  # [BLOCK_S, R] partials
    return out


# ---------------------------------------------------------------- torch reference

def mla_decode_ref(q_latent: torch.Tensor, q_pe: torch.Tensor, pages_layer: torch.Tensor, kv_format: str,
                   kv_lora_rank: int, rope_dim: int, page_table: torch.Tensor, context_lens: torch.Tensor,
                   scale: float, num_kv_splits: int = 4) -> torch.Tensor:
    """Plain-torch `mla_decode_attention`: gather each sequence's rows, dequantise to float32, softmax in
    float32, one sequence at a time (num_kv_splits is ignored); returns [D, H, R] in q's dtype."""
    _check_decode_args(q_latent, q_pe, pages_layer, kv_format, kv_lora_rank, rope_dim, page_table, context_lens)
    page_size = pages_layer.shape[1]
    out = torch.empty_like(q_latent)
    for d in range(q_latent.shape[0]):
        positions = torch.arange(int(context_lens[d]), device=q_latent.device)
        rows = pages_layer[page_table[d, positions // page_size].long(), positions % page_size]  # [L, row_elems]
        c_kv, k_pe = dequantize_latent_ref(rows, kv_lora_rank, rope_dim, kv_format, torch.float32)
        scores = (q_latent[d].float() @ c_kv.T + q_pe[d].float() @ k_pe.T) * scale  # [H, L]
        out[d] = (torch.softmax(scores, dim=-1) @ c_kv).to(q_latent.dtype)
    return out
