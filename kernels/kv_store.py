"""Quantise-and-store of new tokens' K/V into the paged KV cache.

Page format (the contract between this store and `paged_attention.py`), per layer:
    k_cache, v_cache: [num_pages, PAGE_SIZE, num_kv_heads, head_dim]
    k_scale, v_scale: [num_pages, PAGE_SIZE, num_kv_heads] int8   (FP8 only)
A token's slot is ``page_id * PAGE_SIZE + offset``.

- Plain formats (bf16, fp16, fp32): values stored as is, cast to the cache dtype.
- ``fp8_e4m3``: values stored as ``torch.float8_e4m3fn`` (max 448, 3 mantissa
  bits) with one scale per (token, kv head), stored as an int8 power-of-two
  exponent ``e`` (an E8M0-style scale): ``value = fp8 * 2**e``. On write:

      amax = max |x| over head_dim (float32)
      e    = ceil(log2(amax / 448)), clamped to [-64, 63]   (amax == 0 -> -64)
      q    = float8_e4m3fn(clamp(x * 2**-e, -448, 448))     (round to nearest even)

  ``e`` is the smallest exponent with ``amax * 2**-e <= 448``, so each token's
  largest element lands in e4m3's top binade [224, 448]. It is computed exactly
  from amax's float32 bits (amax = 1.m * 2**p and 448 = 1.75 * 2**8, so
  ``e = p - 8 + (1.m > 1.75)``), not through a float log2, which can round
  ``log2(2**k * (1 + 2**-23))`` down to ``k`` and be one off just above a power of two.

Why a power-of-two scale: one byte of scale per head_dim values keeps FP8 at
65 B against BF16's 128 B per (token, head) at head_dim 64 (1.97x the tokens per
byte), and because e4m3 is itself a floating format, scaling by 2**e is exact
and loses no relative precision: every element keeps 3 mantissa bits (relative
rounding error <= 2**-4) down to amax / 2**14, where e4m3 turns subnormal.
Per-token scales need no rescaling of a page when a later token is larger.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["FP8_MAX", "FP8_MIN_EXP", "FP8_MAX_EXP", "store_kv", "store_kv_ref",
           "quantize_fp8_ref", "dequantize_fp8_ref"]

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_MIN_EXP, FP8_MAX_EXP = -64, 63  # range of the int8 scale exponent


# ---------------------------------------------------------------- helpers

@triton.jit
def exp2_int(e):
    """2.0 ** e for integer e in [-126, 127], exactly (built from the float32 bits)."""
    return ((e.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def fp8_exponent(amax):
    """ceil(log2(amax / 448)) clamped to [-64, 63], exactly, for amax >= 0 (float32)."""
    bits = amax.to(tl.int32, bitcast=True)
    p = ((bits >> 23) & 0xFF) - 127  # amax = 1.m * 2**p (amax == 0 gives p = -127 -> clamped)
    e = p - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)  # 0x600000: mantissa of 1.75
    return tl.minimum(tl.maximum(e, -64), 63)


# ---------------------------------------------------------------- kernel

@triton.jit
def _store_kv_kernel(
    # pointers
    k_ptr, v_ptr,  # [T, num_kv_heads, head_dim], any float dtype
    k_cache_ptr, v_cache_ptr,  # [num_pages, PAGE_SIZE, num_kv_heads, head_dim]
    k_scale_ptr, v_scale_ptr,  # [num_pages, PAGE_SIZE, num_kv_heads] int8 (FP8 only)
    slots_ptr,  # [T] int64
    # strides
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cp, stride_ct, stride_ch,  # K and V caches share strides
    stride_sp, stride_st, stride_sh,  # K and V scales share strides
    # meta-parameters
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IS_FP8: tl.constexpr,
):
    """One program per (token, kv head): quantise (FP8) or cast, and store K and V."""
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    slot = tl.load(slots_ptr + pid_t).to(tl.int64)
    page = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM

    k = tl.load(k_ptr + pid_t * stride_kt + pid_h * stride_kh + offs_d, mask=mask_d, other=0.0)
    v = tl.load(v_ptr + pid_t * stride_vt + pid_h * stride_vh + offs_d, mask=mask_d, other=0.0)
    cache_off = page * stride_cp + offset * stride_ct + pid_h * stride_ch  # int64
    if IS_FP8:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        k_exp = fp8_exponent(tl.max(tl.abs(k), axis=0))
        v_exp = fp8_exponent(tl.max(tl.abs(v), axis=0))
        k_q = tl.clamp(k * exp2_int(-k_exp), -448.0, 448.0)  # FP8_MAX
        v_q = tl.clamp(v * exp2_int(-v_exp), -448.0, 448.0)
        tl.store(k_cache_ptr + cache_off + offs_d, k_q.to(tl.float8e4nv), mask=mask_d)
        tl.store(v_cache_ptr + cache_off + offs_d, v_q.to(tl.float8e4nv), mask=mask_d)
        scale_off = page * stride_sp + offset * stride_st + pid_h * stride_sh
        tl.store(k_scale_ptr + scale_off, k_exp.to(tl.int8))
        tl.store(v_scale_ptr + scale_off, v_exp.to(tl.int8))
    else:
        tl.store(k_cache_ptr + cache_off + offs_d, k.to(k_cache_ptr.dtype.element_ty), mask=mask_d)
        tl.store(v_cache_ptr + cache_off + offs_d, v.to(v_cache_ptr.dtype.element_ty), mask=mask_d)


# ---------------------------------------------------------------- launcher

def check_cache_args(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
                     v_scale: torch.Tensor | None) -> bool:
    """Validate a layer's K/V pages (and FP8 scales) against the page format; True for FP8."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache/v_cache must be [num_pages, PAGE_SIZE, kv_heads, head_dim] of one dtype, "
                         f"got {tuple(k_cache.shape)} {k_cache.dtype} / {tuple(v_cache.shape)} {v_cache.dtype}")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must share strides, with a contiguous head_dim")
    if k_cache.device != v_cache.device:
        raise ValueError("k_cache and v_cache must be on one device")
    is_fp8 = k_cache.dtype == torch.float8_e4m3fn
    if is_fp8:
        if k_scale is None or v_scale is None:
            raise ValueError("an fp8_e4m3 cache needs k_scale and v_scale")
        if k_scale.shape != k_cache.shape[:3] or v_scale.shape != k_scale.shape:
            raise ValueError(f"scales must be [num_pages, PAGE_SIZE, kv_heads] = {tuple(k_cache.shape[:3])}, "
                             f"got {tuple(k_scale.shape)} / {tuple(v_scale.shape)}")
        if k_scale.dtype != torch.int8 or v_scale.dtype != torch.int8:
            raise ValueError(f"fp8 scales are int8 exponents, got {k_scale.dtype} / {v_scale.dtype}")
        if k_scale.stride() != v_scale.stride() or k_scale.device != k_cache.device \
                or v_scale.device != k_cache.device:
            raise ValueError("k_scale and v_scale must share strides and the cache's device")
    elif not k_cache.dtype.is_floating_point:
        raise ValueError(f"unsupported cache dtype {k_cache.dtype}")
    elif k_scale is not None or v_scale is not None:
        raise ValueError(f"a {k_cache.dtype} cache takes no scales")
    return is_fp8


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, slots: torch.Tensor) -> None:
    """Write k, v [T, kv_heads, head_dim] at slots [T] (int64) of one layer's pages (Triton)."""
    is_fp8 = check_cache_args(k_cache, v_cache, k_scale, v_scale)
    num_tokens, num_kv_heads, head_dim = k.shape
    if k.shape != v.shape or k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"k, v must be [T, {k_cache.shape[2]}, {k_cache.shape[3]}], "
                         f"got {tuple(k.shape)} / {tuple(v.shape)}")
    if not k.dtype.is_floating_point or not v.dtype.is_floating_point or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k, v must be float tensors with a contiguous head_dim")
    if slots.shape != (num_tokens,) or slots.dtype != torch.int64:
        raise ValueError(f"slots must be [{num_tokens}] int64, got {tuple(slots.shape)} {slots.dtype}")
    if not (k.device == v.device == slots.device == k_cache.device):
        raise ValueError("k, v, slots and the cache must be on one device")
    if num_tokens == 0:
        return
    if not is_fp8:  # placeholders for the unused pointer arguments
        k_scale = v_scale = slots
    scale_strides = k_scale.stride() if is_fp8 else (0, 0, 0)
    _store_kv_kernel[(num_tokens, num_kv_heads)](
        k, v, k_cache, v_cache, k_scale, v_scale, slots,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        *scale_strides,
        PAGE_SIZE=k_cache.shape[1], HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        IS_FP8=is_fp8,
    )


# ---------------------------------------------------------------- torch reference

def quantize_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (float8_e4m3fn [..., head_dim], int8 exponents [...]) per the format above."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    mantissa, p = torch.frexp(amax)  # amax = mantissa * 2**p, mantissa in [0.5, 1); 448 = 0.875 * 2**9
    e = p - 9 + (mantissa > 0.875).to(p.dtype)
    e = torch.where(amax == 0, FP8_MIN_EXP, e).clamp(FP8_MIN_EXP, FP8_MAX_EXP)
    q = torch.ldexp(xf, -e.unsqueeze(-1).float()).clamp(-FP8_MAX, FP8_MAX)
    return q.to(torch.float8_e4m3fn), e.to(torch.int8)


def dequantize_fp8_ref(q: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn [..., head_dim] and int8 exponents [...] -> float32 [..., head_dim]."""
    return torch.ldexp(q.view(torch.float8_e4m3fn).float(), e.unsqueeze(-1).float())


_FP8_TABLES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def dequantize_fp8_table(raw: torch.Tensor, e: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The CPU runtime's dequantiser: fp8 bytes (uint8 [..., head_dim]) and int8 exponents [..., 1]
    -> `dtype`, equal to `dequantize_fp8_ref`. A 256-entry table lookup is ~2x faster than `.to()`."""
    key = (dtype, raw.device)
    if key not in _FP8_TABLES:
        _FP8_TABLES[key] = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(dtype).to(raw.device)
    values = _FP8_TABLES[key].index_select(0, raw.reshape(-1).int()).view(raw.shape)
    return values.mul_(torch.exp2(e.to(dtype)))


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, slots: torch.Tensor) -> None:
    """Plain-torch `store_kv`: same arguments, same bytes written. The CPU runtime's path for plain formats,
    and for FP8 where `kernels/cpu_kv_store.py`'s C kernel cannot run (the reference its tests compare to)."""
    is_fp8 = check_cache_args(k_cache, v_cache, k_scale, v_scale)
    page_size = k_cache.shape[1]
    if is_fp8:
        q, e = quantize_fp8_ref(torch.stack((k, v)))  # K and V in one pass: half the ops of a decode step's store
        q = q.view(torch.uint8)  # index_put / index_copy on float8 is not implemented on every device: the bytes
        if k_cache.is_contiguous() and k_scale.is_contiguous():  # the CPU hot path: row copies
            for i, (cache, scale) in enumerate(((k_cache, k_scale), (v_cache, v_scale))):
                cache.view(torch.uint8).view(-1, *cache.shape[2:]).index_copy_(0, slots, q[i])
                scale.view(-1, scale.shape[2]).index_copy_(0, slots, e[i])
        else:
            pages, offsets = slots // page_size, slots % page_size
            for i, (cache, scale) in enumerate(((k_cache, k_scale), (v_cache, v_scale))):
                cache.view(torch.uint8)[pages, offsets] = q[i]
                scale[pages, offsets] = e[i]
    elif k_cache.is_contiguous() and v_cache.is_contiguous():  # the CPU hot path: two row copies
        rows = (-1, *k_cache.shape[2:])
        k_cache.view(rows).index_copy_(0, slots, k.to(k_cache.dtype))
        v_cache.view(rows).index_copy_(0, slots, v.to(v_cache.dtype))
    else:
        pages, offsets = slots // page_size, slots % page_size
        k_cache[pages, offsets] = k.to(k_cache.dtype)
        v_cache[pages, offsets] = v.to(v_cache.dtype)
