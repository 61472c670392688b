"""Latent KV rows for multi-head latent attention (MLA): the page format and its store.

An MLA layer caches ONE row per token: the kv_a_layernorm-normalised latent c_kv
(R = kv_lora_rank values) followed by the roped key k_pe (Dr = qk_rope_head_dim
values, in the interleaved-pair order of `backend/rope.py`). Pages, per layer:

    pages_layer: [num_pages, PAGE_SIZE, row_elems]      slot = page_id * PAGE_SIZE + offset

Formats (the names of the GQA cache's `--kv-format` values):

- ``fp32`` / ``bf16``: row = [c_kv | k_pe] in that dtype, (R + Dr) * 4 or * 2 bytes
  (Kimi K2.x / DeepSeek-V3 / GLM-5, R = 512, Dr = 64: 1,152 B per token per layer in bf16).
- ``fp8_e4m3``: a uint8 row of R + 4G + 2Dr bytes (656 B for those models), G = ceil(R / 128):

      [ R e4m3 latent values | G float32 scales | Dr bfloat16 rope values ]

  Group g covers latent values [128g, min(128(g+1), R)). On write, in float32:

      amax_g  = max |x| over the group            scale_g = amax_g / 448  (1.0 when amax_g == 0)
      q       = float8_e4m3fn(clamp(x / scale_g, -448, 448))   round to nearest, ties to even

  and on read x = float(q) * scale_g. Each group's largest value maps to 448, so
  every value keeps e4m3's 3 mantissa bits (relative error <= 2**-4) down to
  amax_g * 2**-14 (where e4m3 turns subnormal). One scale per 128 values rather
  than per row: the latent's channels differ in magnitude, and a per-tensor or
  per-row scale is what published reports found degrading these models.
  The roped key stays bfloat16: quantising it would coarsen positions (RoPE
  encodes them in angles) and it is only Dr / (R + Dr) = 1/9 of the values.
  Byte views of a row: ``row[..., :R].view(float8_e4m3fn)``,
  ``row[..., R:R+4G].view(float32)``, ``row[..., R+4G:].view(bfloat16)``; they are
  aligned because R % 4 == 0 (required) and Dr is even (required: RoPE rotates pairs).

The Triton store (`store_latent_triton`, one program per token, groups quantised in
registers) rounds to e4m3 and to bfloat16 itself, with integer arithmetic on the
float32 bits (`round_to_e4m3`, `round_to_bf16`), and only then casts values that
are exactly representable. It therefore writes the same bytes as the torch
reference on CUDA and under the Triton interpreter, whose own float32 -> fp8/bf16
casts do not round to nearest even. `store_latent` runs it on CUDA and the torch
reference (`store_latent_ref`) elsewhere.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backend.errors import InvalidRequest
from kernels.exact_div import div_exact

__all__ = ["LATENT_FORMATS", "FP8_MAX", "FP8_GROUP", "latent_row_bytes", "latent_row_elems", "latent_row_dtype",
           "check_latent_dims", "quantize_latent_ref", "dequantize_latent_ref", "store_latent",
           "store_latent_triton", "store_latent_ref"]

LATENT_FORMATS = ("fp32", "bf16", "fp8_e4m3")
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_GROUP = 128  # latent values per fp8 scale
_ROW_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8_e4m3": torch.uint8}


# ---------------------------------------------------------------- the format

def check_latent_dims(kv_lora_rank: int, rope_dim: int, kv_format: str) -> None:
    """Raise InvalidRequest unless (R, Dr, format) describe a storable row."""
    if kv_format not in LATENT_FORMATS:
        raise InvalidRequest(f"unknown latent KV format {kv_format!r}; expected one of {LATENT_FORMATS}")
    if kv_lora_rank <= 0 or rope_dim < 0:
        raise InvalidRequest(f"kv_lora_rank must be > 0 and rope_dim >= 0, got {kv_lora_rank}, {rope_dim}")
    if kv_format == "fp8_e4m3" and (kv_lora_rank % 4 or rope_dim % 2):
        raise InvalidRequest(f"fp8_e4m3 latent rows need kv_lora_rank % 4 == 0 and an even rope_dim "
                             f"(aligned scale and rope views), got {kv_lora_rank}, {rope_dim}")


def latent_row_bytes(kv_lora_rank: int, rope_dim: int, kv_format: str) -> int:
    """Bytes of one token's row in one layer: (R + Dr) * 4 / * 2, or R + 4 * ceil(R/128) + 2 * Dr for fp8."""
    check_latent_dims(kv_lora_rank, rope_dim, kv_format)
    if kv_format == "fp8_e4m3":
        return kv_lora_rank + 4 * triton.cdiv(kv_lora_rank, FP8_GROUP) + 2 * rope_dim
    return (kv_lora_rank + rope_dim) * _ROW_DTYPES[kv_format].itemsize


def latent_row_dtype(kv_format: str) -> torch.dtype:
    """The pool's element dtype: float32, bfloat16, or uint8 (fp8 rows are bytes)."""
    if kv_format not in LATENT_FORMATS:
        raise InvalidRequest(f"unknown latent KV format {kv_format!r}; expected one of {LATENT_FORMATS}")
    return _ROW_DTYPES[kv_format]


def latent_row_elems(kv_lora_rank: int, rope_dim: int, kv_format: str) -> int:
    """Elements of `latent_row_dtype` per row: the pool's last dimension."""
    return latent_row_bytes(kv_lora_rank, rope_dim, kv_format) // _ROW_DTYPES[kv_format].itemsize


# ---------------------------------------------------------------- torch reference

def quantize_latent_ref(latent: torch.Tensor, k_pe: torch.Tensor, kv_format: str) -> torch.Tensor:
    """latent [..., R] and k_pe [..., Dr] (any float dtype) -> rows [..., row_elems] in the pool's dtype."""
    kv_lora_rank, rope_dim = latent.shape[-1], k_pe.shape[-1]
    check_latent_dims(kv_lora_rank, rope_dim, kv_format)
    if latent.shape[:-1] != k_pe.shape[:-1]:
        raise InvalidRequest(f"latent {tuple(latent.shape)} and k_pe {tuple(k_pe.shape)} differ in leading dims")
    if kv_format != "fp8_e4m3":
        return torch.cat([latent, k_pe.to(latent.dtype)], dim=-1).to(_ROW_DTYPES[kv_format])
    num_groups = triton.cdiv(kv_lora_rank, FP8_GROUP)
    x = latent.float()
    padded = torch.nn.functional.pad(x, (0, num_groups * FP8_GROUP - kv_lora_rank))
    groups = padded.unflatten(-1, (num_groups, FP8_GROUP))  # [..., G, 128]
    amax = groups.abs().amax(dim=-1)  # [..., G]
    scale = torch.where(amax == 0, torch.ones_like(amax), div_exact(amax, FP8_MAX))  # alike on every device
    q = (groups / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q = q.flatten(-2)[..., :kv_lora_rank]
    return torch.cat([q.view(torch.uint8), scale.contiguous().view(torch.uint8),
                      k_pe.to(torch.bfloat16).contiguous().view(torch.uint8)], dim=-1)


def dequantize_latent_ref(rows: torch.Tensor, kv_lora_rank: int, rope_dim: int, kv_format: str,
                          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [..., row_elems] -> (latent [..., R], k_pe [..., Dr]) in `dtype` (fp8: float(q) * scale in float32)."""
    row_elems = latent_row_elems(kv_lora_rank, rope_dim, kv_format)
    if rows.shape[-1] != row_elems or rows.dtype != _ROW_DTYPES[kv_format]:
        raise InvalidRequest(f"{kv_format} rows must be [..., {row_elems}] {_ROW_DTYPES[kv_format]}, "
                             f"got {tuple(rows.shape)} {rows.dtype}")
    if kv_format != "fp8_e4m3":
        return rows[..., :kv_lora_rank].to(dtype), rows[..., kv_lora_rank:].to(dtype)
    num_groups = triton.cdiv(kv_lora_rank, FP8_GROUP)
    rows = rows.contiguous()
    q = rows[..., :kv_lora_rank].view(torch.float8_e4m3fn).float()
    scale = rows[..., kv_lora_rank:kv_lora_rank + 4 * num_groups].view(torch.float32)  # [..., G]
    latent = q * scale.repeat_interleave(FP8_GROUP, dim=-1)[..., :kv_lora_rank]
    k_pe = rows[..., kv_lora_rank + 4 * num_groups:].view(torch.bfloat16)
    return latent.to(dtype), k_pe.to(dtype)


def _check_store_args(latent: torch.Tensor, k_pe: torch.Tensor, pages_layer: torch.Tensor, slots: torch.Tensor,
                      kv_format: str) -> None:
    """Validate a store's arguments against the row format (InvalidRequest on any mismatch)."""
    num_tokens, kv_lora_rank = latent.shape if latent.dim() == 2 else (None, None)
    if kv_lora_rank is None or k_pe.dim() != 2 or k_pe.shape[0] != num_tokens:
        raise InvalidRequest(f"latent and k_pe must be [T, R] and [T, Dr], got {tuple(latent.shape)}, "
                             f"{tuple(k_pe.shape)}")
    if not latent.dtype.is_floating_point or not k_pe.dtype.is_floating_point:
        raise InvalidRequest(f"latent and k_pe must be float, got {latent.dtype}, {k_pe.dtype}")
    row_elems = latent_row_elems(kv_lora_rank, k_pe.shape[1], kv_format)
    if pages_layer.dim() != 3 or pages_layer.shape[2] != row_elems or pages_layer.dtype != _ROW_DTYPES[kv_format]:
        raise InvalidRequest(f"{kv_format} pages must be [num_pages, page_size, {row_elems}] "
                             f"{_ROW_DTYPES[kv_format]}, got {tuple(pages_layer.shape)} {pages_layer.dtype}")
    if slots.shape != (num_tokens,) or slots.dtype != torch.int64:
        raise InvalidRequest(f"slots must be [{num_tokens}] int64, got {tuple(slots.shape)} {slots.dtype}")
    if not (latent.device == k_pe.device == pages_layer.device == slots.device):
        raise InvalidRequest("latent, k_pe, pages and slots must be on one device")


def store_latent_ref(latent: torch.Tensor, k_pe: torch.Tensor, pages_layer: torch.Tensor, slots: torch.Tensor,
                     kv_format: str) -> None:
    """Plain-torch store: rows of latent [T, R] and k_pe [T, Dr] written at slots [T] (int64) of pages_layer."""
    _check_store_args(latent, k_pe, pages_layer, slots, kv_format)
    rows = quantize_latent_ref(latent, k_pe, kv_format)  # [T, row_elems]
    if pages_layer.is_contiguous():
        pages_layer.view(-1, pages_layer.shape[2]).index_copy_(0, slots, rows)
    else:
        page_size = pages_layer.shape[1]
        pages_layer[slots // page_size, slots % page_size] = rows


# ---------------------------------------------------------------- Triton helpers

@triton.jit
def round_to_bf16(x):
    """float32 x rounded to the nearest bfloat16 (ties to even), still float32 (exact to cast)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536: 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def round_to_e4m3(x):
    """float32 x with |x| <= 448 rounded to the nearest float8_e4m3fn value (ties to even), still float32.

    Normal range (|x| >= 2**-6): drop 20 of float32's 23 mantissa bits with round-half-even on the
    bits (a carry into the exponent is correct there). Subnormal range: steps of 2**-9, rounded by
    float32 addition: |x| + 2**14 has a ulp of 2**-9. The sign is kept, so -0.0 and tiny negatives
    give -0 as torch's cast does."""
    bits = x.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)  # 0xFFF00000
    tiny = (tl.abs(x) + 16384.0) - 16384.0  # 16384 = 2**14
    tiny = (tiny.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)  # sign bit
    return tl.where(tl.abs(x) < 0.015625, tiny, normal)  # 0.015625 = 2**-6, e4m3's smallest normal


# ---------------------------------------------------------------- kernel

@triton.jit
def _store_latent_kernel(
    # pointers
    latent_ptr,  # [T, R], any float dtype
    k_pe_ptr,  # [T, Dr], any float dtype
    rows_ptr,  # pages_layer: [num_pages, PAGE_SIZE, row_elems] float32 / bfloat16 (plain formats)
    fp8_ptr, scale_ptr, rope_ptr,  # the same fp8 pages viewed as float8_e4m3fn, float32, bfloat16
    slots_ptr,  # [T] int64
    # strides
    stride_lt, stride_pt,
    stride_rp, stride_rt,  # pages, in elements of rows_ptr (bytes for fp8)
    # meta-parameters
    PAGE_SIZE: tl.constexpr, KV_LORA_RANK: tl.constexpr, ROPE_DIM: tl.constexpr,
    NUM_GROUPS: tl.constexpr, BLOCK_G: tl.constexpr, GROUP: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_DR: tl.constexpr, IS_FP8: tl.constexpr, ROUND_BF16: tl.constexpr,
):
    """One program per token: quantise the latent's groups in registers (fp8) or cast, and store the row."""
    pid_t = tl.program_id(0)
    slot = tl.load(slots_ptr + pid_t).to(tl.int64)
    row_off = (slot // PAGE_SIZE) * stride_rp + (slot % PAGE_SIZE) * stride_rt  # int64
    offs_dr = tl.arange(0, BLOCK_DR)
    mask_dr = offs_dr < ROPE_DIM
    k_pe = tl.load(k_pe_ptr + pid_t * stride_pt + offs_dr, mask=mask_dr, other=0.0).to(tl.float32)
    if IS_FP8:
        # latent as [BLOCK_G, GROUP]: one row per scale group
        offs_r = tl.arange(0, BLOCK_G)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        mask_r = offs_r < KV_LORA_RANK
        x = tl.load(latent_ptr + pid_t * stride_lt + offs_r, mask=mask_r, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=1)  # [BLOCK_G]
        scale = tl.where(amax == 0.0, 1.0, tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)))
        q = tl.clamp(tl.math.div_rn(x, scale[:, None]), -448.0, 448.0)  # 448: FP8_MAX
        tl.store(fp8_ptr + row_off + offs_r, round_to_e4m3(q).to(tl.float8e4nv), mask=mask_r)
        offs_g = tl.arange(0, BLOCK_G)
        tl.store(scale_ptr + row_off // 4 + KV_LORA_RANK // 4 + offs_g, scale, mask=offs_g < NUM_GROUPS)
        rope_off = row_off // 2 + (KV_LORA_RANK + 4 * NUM_GROUPS) // 2
        tl.store(rope_ptr + rope_off + offs_dr, round_to_bf16(k_pe).to(tl.bfloat16), mask=mask_dr)
    else:
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < KV_LORA_RANK
        x = tl.load(latent_ptr + pid_t * stride_lt + offs_r, mask=mask_r, other=0.0).to(tl.float32)
        if ROUND_BF16:
            x = round_to_bf16(x)
            k_pe = round_to_bf16(k_pe)
        out_ty = rows_ptr.dtype.element_ty
        tl.store(rows_ptr + row_off + offs_r, x.to(out_ty), mask=mask_r)
        tl.store(rows_ptr + row_off + KV_LORA_RANK + offs_dr, k_pe.to(out_ty), mask=mask_dr)


# ---------------------------------------------------------------- launchers

def store_latent_triton(latent: torch.Tensor, k_pe: torch.Tensor, pages_layer: torch.Tensor, slots: torch.Tensor,
                        kv_format: str) -> None:
    """The Triton store (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1); same bytes as the reference."""
    _check_store_args(latent, k_pe, pages_layer, slots, kv_format)
    if latent.stride(1) != 1 or k_pe.stride(1) != 1 or pages_layer.stride(2) != 1:
        raise InvalidRequest("latent, k_pe and pages need a contiguous last dimension")
    num_tokens, kv_lora_rank = latent.shape
    rope_dim = k_pe.shape[1]
    if num_tokens == 0:
        return
    is_fp8 = kv_format == "fp8_e4m3"
    if is_fp8:
        if pages_layer.stride(0) % 4 or pages_layer.stride(1) % 4 or pages_layer.storage_offset() % 4:
            raise InvalidRequest("fp8 latent pages need 4-byte aligned rows")
        # the same bytes as float8 / float32 / bfloat16 (row_bytes % 4 == 0, so the views are exact)
        views = tuple(pages_layer.view(dtype) for dtype in (torch.float8_e4m3fn, torch.float32, torch.bfloat16))
    else:
        views = (pages_layer, pages_layer, pages_layer)  # placeholders for the unused fp8 pointers
    num_groups = triton.cdiv(kv_lora_rank, FP8_GROUP)
    _store_latent_kernel[(num_tokens,)](
        latent, k_pe, pages_layer, *views, slots,
        latent.stride(0), k_pe.stride(0), pages_layer.stride(0), pages_layer.stride(1),
        PAGE_SIZE=pages_layer.shape[1], KV_LORA_RANK=kv_lora_rank, ROPE_DIM=rope_dim,
        NUM_GROUPS=num_groups, BLOCK_G=triton.next_power_of_2(num_groups), GROUP=FP8_GROUP,
        BLOCK_R=triton.next_power_of_2(kv_lora_rank), BLOCK_DR=triton.next_power_of_2(max(rope_dim, 1)),
        IS_FP8=is_fp8, ROUND_BF16=pages_layer.dtype == torch.bfloat16,
    )


def store_latent(latent: torch.Tensor, k_pe: torch.Tensor, pages_layer: torch.Tensor, slots: torch.Tensor,
                 kv_format: str) -> None:
    """Write latent [T, R] and k_pe [T, Dr] as rows at slots [T] (int64) of one layer's pages
    [num_pages, page_size, row_elems]: the Triton kernel on CUDA, `store_latent_ref` elsewhere."""
    if pages_layer.is_cuda:
        store_latent_triton(latent, k_pe, pages_layer, slots, kv_format)
    else:
        store_latent_ref(latent, k_pe, pages_layer, slots, kv_format)
