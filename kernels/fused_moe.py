"""Fused MoE: the routed experts of a mixture-of-experts layer for SwiGLU experts.

For hidden states x [T, H], each token t chose k experts topk_ids[t] with weights
topk_weights[t] (float32, already normalised and scaled by the router):

    out[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),   e = topk_ids[t, j]

Expert weights are stacked per expert, as transformers v5 fuses them:

    w13  [E, 2I, H]   gate rows 0..I-1 first, then up rows I..2I-1   (gate_up_proj)
    w2   [E, H, I]                                                  (down_proj)

in one of the project's weight formats (`backend/weight_formats.py` has their numerics),
applied per expert along the stacked first dimension:

    fmt    w13 / w2                      w13_scale / w2_scale                       zeros
    fp32   float32   [E, N, K]           -                                          -
    bf16   bfloat16  [E, N, K]           -                                          -
    fp8    float8_e4m3fn [E, N, K]       float32 [E, ceil(N/128), ceil(K/128)]      -
                                         or [E, N, ceil(K/128)] (expanded per row)
    int4   uint8 [E, N, K/2]             bfloat16 [E, N, ceil(K/g)]                 bfloat16, as scales
           (low nibble first)

(N, K) is (2I, H) for w13 and (H, I) for w2. FP8: W = float(q) * scale[n // rows, k // 128]
with rows 128 (checkpoint blocks) or 1 (the runtime's row-expanded scales, which fusing
gate and up rows needs when I is not a multiple of 128). INT4: W = (q - 8) * scale + zero,
group g = `group_size` (128 or 32) along K, a partial last group allowed, K even.

**Routing layout** (`moe_align`): the T*k (token, choice) slots, slot s = t*k + j, are
sorted by expert (stable: token order inside an expert), and each expert's run is padded
to a multiple of BLOCK_M with the value T*k; `block_expert` names the expert of each
BLOCK_M block. An expert with no slot has no block, so nothing is launched for it. The
grid is sized without a host sync from the bound on the padded length,
T*k + min(E, T*k) * (BLOCK_M - 1); programs past the real padded count exit at once.

**Two launches** (the vLLM design, with SiLU·mul moved into the first epilogue):
1. `_gate_up_kernel`, grid (blocks, cdiv(I, BLOCK_N)): a program gathers its block's
   token rows of x, multiplies them by the expert's gate rows n and up rows I + n
   (two float32 accumulators sharing each x tile) and writes silu(gate) * up to the
   intermediate act [T*k, I] at the slots' rows, in x's dtype.
2. `_down_kernel`, grid (blocks, cdiv(H, BLOCK_N)): act rows of the block @ w2[e].T,
   times the slot's routing weight, written to y [T*k, H] in x's dtype.
Then out = y.view(T, k, H).sum(1) (float32 accumulation, one rounding). Each slot is
written by exactly one program, so the result is deterministic (no atomics).

Weights are dequantised in registers, tile by tile, exactly as `kernels/fp8_gemm.py`
and `kernels/w4a16_gemm.py` do (BLOCK_K divides 128 and the INT4 group, so a tile
needs one scale per row). Dot operands are x's dtype (float32: IEEE, no TF32; float32
under the interpreter, whose bfloat16 dot is broken); accumulation is float32.
`fused_moe_ref` is the same math in plain torch: dequantise, per-expert GEMMs in float32,
the intermediate and the weighted per-slot outputs rounded to x's dtype where the
kernel stores them, a float32 sum over k.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.fp8_gemm import dequantize_fp8_blocks_ref
from kernels.paged_attention import _dot_dtype
from kernels.w4a16_gemm import _dequant_tile, dequantize_int4_ref

__all__ = ["FORMATS", "MoeAlignment", "moe_align", "fused_moe", "fused_moe_ref", "dequantize_experts_ref"]

FORMATS = ("fp32", "bf16", "fp8", "int4")
FP8_SCALE_K = 128  # columns per FP8 scale (the checkpoints' 128 x 128 blocks)
_FMT_CODE = {"fp32": 0, "bf16": 0, "fp8": 1, "int4": 2}  # the kernels' FMT: dense, FP8, INT4
_DENSE_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16}


# ---------------------------------------------------------------- routing layout

class MoeAlignment(NamedTuple):
    """Token slots grouped by expert in BLOCK_M-aligned runs (see the module docstring)."""

    sorted_ids: torch.Tensor  # [num_blocks * BLOCK_M] int32: slot t*k + j, or T*k for padding
    block_expert: torch.Tensor  # [num_blocks] int32: expert of each block, -1 past num_padded
    num_padded: torch.Tensor  # [1] int32: slots in use, a multiple of BLOCK_M (stays on the device)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    """Sort the slots of topk_ids [T, k] (ids in 0..num_experts-1) by expert, each expert's run
    padded to a multiple of `block_m`. num_blocks is the bound floor((T*k + min(E, T*k) *
    (block_m - 1)) / block_m), so nothing here waits for the device."""
    flat = topk_ids.reshape(-1).long()  # [n] expert of slot s = t*k + j
    n, dev = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    ends = padded.cumsum(0)  # [E] end of each expert's run
    order = torch.sort(flat, stable=True).indices  # [n] slots by expert, token order inside
    expert_of = flat[order]
    rank = torch.arange(n, device=dev) - (counts.cumsum(0) - counts)[expert_of]  # place inside its expert
    num_blocks = (n + min(num_experts, n) * (block_m - 1)) // block_m
    sorted_ids = torch.full((num_blocks * block_m,), n, dtype=torch.int32, device=dev)
    sorted_ids[ends[expert_of] - padded[expert_of] + rank] = order.to(torch.int32)
    block_starts = torch.arange(num_blocks, device=dev) * block_m
    block_expert = torch.searchsorted(ends, block_starts, right=True)  # first expert whose run ends after
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return MoeAlignment(sorted_ids, block_expert, ends[-1:].to(torch.int32))


# ---------------------------------------------------------------- helpers

@triton.jit
def _weight_tile(w_ptr, s_ptr, z_ptr, offs_n, offs_k, k0, mask_n, K,
                 stride_wn, stride_sn, stride_sk,
                 FMT: tl.constexpr, SCALE_N: tl.constexpr, GROUP: tl.constexpr):
    """One expert's [BLOCK_N, BLOCK_K] weight tile at rows offs_n, columns offs_k (one scale column)."""
    if FMT == 2:  # INT4: codes, per-row group scale and zero
        w = _dequant_tile(w_ptr, s_ptr, z_ptr, offs_n, k0, mask_n, K, stride_wn, stride_sn, stride_sk, GROUP,
                          offs_k.shape[0])
    else:
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
                    mask=mask_n[:, None] & (offs_k[None, :] < K), other=0.0)
        if FMT == 1:  # FP8: exact conversion, then the block scale of each row
            scale = tl.load(s_ptr + (offs_n // SCALE_N) * stride_sn + (k0 // 128) * stride_sk, mask=mask_n,
                            other=0.0)
            w = w.to(tl.float32) * scale[:, None]
    return w


# ---------------------------------------------------------------- kernels

@triton.jit
def _gate_up_kernel(
    # pointers
    x_ptr,  # [T, H]
    w_ptr,  # [E, 2I, H] (int4: [E, 2I, H/2] uint8)
    s_ptr, z_ptr,  # scales / zeros of w13 (unused for dense)
    sorted_ids_ptr, block_expert_ptr, num_padded_ptr,  # the MoeAlignment
    act_ptr,  # [T*k, I] out: silu(gate) * up
    # sizes
    num_slots, I, H,
    # strides
    stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_at,
    # meta-parameters
    TOP_K: tl.constexpr, FMT: tl.constexpr, SCALE_N: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One program per (block of one expert's slots, BLOCK_N intermediate columns)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    slots = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    mask_m = slots < num_slots
    tokens = (slots // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < I
    w_ptr += expert * stride_we
    s_ptr += expert * stride_se
    z_ptr += expert * stride_se
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + tokens[:, None] * stride_xt + offs_k[None, :],
                    mask=mask_m[:, None] & (offs_k[None, :] < H), other=0.0).to(DOT_DTYPE)  # [BLOCK_M, BLOCK_K]
        w_gate = _weight_tile(w_ptr, s_ptr, z_ptr, offs_n, offs_k, k0, mask_n, H, stride_wn, stride_sn, stride_sk,
                              FMT, SCALE_N, GROUP)  # [BLOCK_N, BLOCK_K]
        w_up = _weight_tile(w_ptr, s_ptr, z_ptr, offs_n + I, offs_k, k0, mask_n, H, stride_wn, stride_sn,
                            stride_sk, FMT, SCALE_N, GROUP)
        acc_gate += tl.dot(a, tl.trans(w_gate.to(DOT_DTYPE)), input_precision=DOT_PRECISION)
        acc_up += tl.dot(a, tl.trans(w_up.to(DOT_DTYPE)), input_precision=DOT_PRECISION)
    act = acc_gate * tl.sigmoid(acc_gate) * acc_up  # silu(gate) * up, float32
    act_ptrs = act_ptr + slots[:, None].to(tl.int64) * stride_at + offs_n[None, :]
    tl.store(act_ptrs, act.to(act_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _down_kernel(
    # pointers
    act_ptr,  # [T*k, I]
    w_ptr,  # [E, H, I] (int4: [E, H, I/2] uint8)
    s_ptr, z_ptr,  # scales / zeros of w2 (unused for dense)
    topk_weights_ptr,  # [T*k] float32
    sorted_ids_ptr, block_expert_ptr, num_padded_ptr,  # the MoeAlignment
    y_ptr,  # [T*k, H] out: weighted expert outputs per slot
    # sizes
    num_slots, H, I,
    # strides
    stride_at, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_yt,
    # meta-parameters
    FMT: tl.constexpr, SCALE_N: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One program per (block of one expert's slots, BLOCK_N hidden columns)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    slots = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    mask_m = slots < num_slots
    rows = slots.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < H
    w_ptr += expert * stride_we
    s_ptr += expert * stride_se
    z_ptr += expert * stride_se
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(act_ptr + rows[:, None] * stride_at + offs_k[None, :],
                    mask=mask_m[:, None] & (offs_k[None, :] < I), other=0.0).to(DOT_DTYPE)  # [BLOCK_M, BLOCK_K]
        w = _weight_tile(w_ptr, s_ptr, z_ptr, offs_n, offs_k, k0, mask_n, I, stride_wn, stride_sn, stride_sk,
                         FMT, SCALE_N, GROUP)  # [BLOCK_N, BLOCK_K]
        acc += tl.dot(a, tl.trans(w.to(DOT_DTYPE)), input_precision=DOT_PRECISION)
    routing = tl.load(topk_weights_ptr + rows, mask=mask_m, other=0.0)  # [BLOCK_M] float32
    acc = acc * routing[:, None]
    y_ptrs = y_ptr + rows[:, None] * stride_yt + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


# ---------------------------------------------------------------- launcher

class _Dims(NamedTuple):
    tokens: int  # T
    top_k: int  # k
    experts: int  # E
    hidden: int  # H
    inter: int  # I


def _check_weight(name: str, fmt: str, w: torch.Tensor, scale: torch.Tensor | None, zeros: torch.Tensor | None,
                  e: int, n: int, k: int, group_size: int) -> int:
    """Check one stacked expert weight of logical shape [e, n, k]; return the FP8 scale rows (1 or 128)."""
    stored_k = k // 2 if fmt == "int4" else k
    want_dtype = {"fp8": torch.float8_e4m3fn, "int4": torch.uint8}.get(fmt) or _DENSE_DTYPE[fmt]
    if w.dtype != want_dtype or tuple(w.shape) != (e, n, stored_k) or w.stride(2) != 1:
        raise ValueError(f"{name} must be {want_dtype} [{e}, {n}, {stored_k}] with contiguous rows for fmt {fmt!r}, "
                         f"got {tuple(w.shape)} {w.dtype}")
    if fmt in ("fp32", "bf16"):
        if scale is not None or zeros is not None:
            raise ValueError(f"fmt {fmt!r} takes no scales or zeros for {name}")
        return 1
    if scale is None:
        raise ValueError(f"fmt {fmt!r} needs {name}_scale")
    if fmt == "fp8":
        blocks = -(-n // 128), -(-k // FP8_SCALE_K)
        if scale.dtype != torch.float32 or tuple(scale.shape) not in ((e, *blocks), (e, n, blocks[1])):
            raise ValueError(f"{name}_scale must be float32 [{e}, {blocks[0]}, {blocks[1]}] (128 x 128 blocks) or "
                             f"[{e}, {n}, {blocks[1]}] (per row), got {tuple(scale.shape)} {scale.dtype}")
        if zeros is not None:
            raise ValueError(f"fmt 'fp8' takes no {name}_zeros")
        return 1 if scale.shape[1] == n else 128
    if k % 2:
        raise ValueError(f"int4 packs two codes per byte along K, so K must be even; {name} has K = {k}")
    groups = -(-k // group_size)
    for part, t in (("scale", scale), ("zeros", zeros)):
        if t is None or tuple(t.shape) != (e, n, groups) or not t.dtype.is_floating_point:
            raise ValueError(f"{name}_{part} must be float [{e}, {n}, {groups}] (group size {group_size}), got "
                             f"{None if t is None else (tuple(t.shape), t.dtype)}")
    if scale.stride() != zeros.stride():
        raise ValueError(f"{name}_scale and {name}_zeros must share strides")
    return 1


def _check_args(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, fmt: str, w13_scale: torch.Tensor | None, w2_scale: torch.Tensor | None,
                w13_zeros: torch.Tensor | None, w2_zeros: torch.Tensor | None, group_size: int
                ) -> tuple[_Dims, int, int]:
    """Shapes, dtypes, strides and devices of every argument; returns the dims and FP8 scale rows."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or x.stride(1) != 1:
        raise ValueError(f"x must be [T, H] float32/bfloat16/float16 with contiguous rows, got "
                         f"{tuple(x.shape)} {x.dtype}")
    t, h = x.shape
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32/int64 [{t}, k], got {tuple(topk_ids.shape)} {topk_ids.dtype}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape) or not topk_weights.dtype.is_floating_point:
        raise ValueError(f"topk_weights must be float {list(topk_ids.shape)}, got {tuple(topk_weights.shape)} "
                         f"{topk_weights.dtype}")
    if fmt == "int4" and (group_size < 16 or group_size & (group_size - 1)):
        raise ValueError(f"group_size must be a power of two >= 16, got {group_size}")
    if w13.dim() != 3 or w2.dim() != 3 or w13.shape[1] % 2:
        raise ValueError(f"w13 must be [E, 2I, K] and w2 [E, H, K], got {tuple(w13.shape)} and {tuple(w2.shape)}")
    e, inter = w13.shape[0], w13.shape[1] // 2
    rows13 = _check_weight("w13", fmt, w13, w13_scale, w13_zeros, e, 2 * inter, h, group_size)
    rows2 = _check_weight("w2", fmt, w2, w2_scale, w2_zeros, e, h, inter, group_size)
    tensors = [x, w13, w2, topk_weights, topk_ids] + [s for s in (w13_scale, w2_scale, w13_zeros, w2_zeros) if s
                                                      is not None]
    if len({s.device for s in tensors}) != 1:
        raise ValueError("every tensor must be on one device")
    return _Dims(t, topk_ids.shape[1], e, h, inter), rows13, rows2


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, fmt: str, w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None, w13_zeros: torch.Tensor | None = None,
              w2_zeros: torch.Tensor | None = None, group_size: int = 128) -> torch.Tensor:
    """The routed experts' output [T, H] in x's dtype (no shared experts; the router's
    scaling already in topk_weights).

    x [T, H] float32/bfloat16/float16; topk_ids [T, k] int32/int64 in 0..E-1, distinct per
    row; topk_weights [T, k] float (used as float32). `fmt` is "fp32", "bf16", "fp8" or
    "int4" and fixes what w13 [E, 2I, ...] / w2 [E, H, ...] and their scales and zeros
    hold (the table in the module docstring); `group_size` is the INT4 group. Raises
    ValueError on any shape, dtype, stride or device mismatch.
    """
    dims, rows13, rows2 = _check_args(x, w13, w2, topk_weights, topk_ids, fmt, w13_scale, w2_scale, w13_zeros,
                                      w2_zeros, group_size)
    t, k, e, h, inter = dims
    if t == 0 or k == 0 or inter == 0:
        return torch.zeros_like(x)
    num_slots = t * k
    per_expert = num_slots / min(e, num_slots)  # slots an expert that is hit gets, on average
    block_m = 16 if per_expert <= 16 else (32 if per_expert <= 32 else 64)
    align = moe_align(topk_ids, e, block_m)
    num_blocks = align.block_expert.numel()
    routing = topk_weights.reshape(-1).to(torch.float32).contiguous()  # [T*k]
    act = torch.empty(num_slots, inter, dtype=x.dtype, device=x.device)  # [T*k, I]
    y = torch.empty(num_slots, h, dtype=x.dtype, device=x.device)  # [T*k, H]
    dummy = torch.empty(1, 1, 1, dtype=torch.float32, device=x.device)  # dense weights have no scales
    s13, z13 = w13_scale if w13_scale is not None else dummy, w13_zeros if w13_zeros is not None else dummy
    s2, z2 = w2_scale if w2_scale is not None else dummy, w2_zeros if w2_zeros is not None else dummy
    dot_dtype = _dot_dtype(x.dtype) if x.dtype != torch.float16 else tl.float16
    code = _FMT_CODE[fmt]
    block_k = min(64, group_size) if fmt == "int4" else 64  # divides the INT4 group and FP8's 128 columns
    common = dict(FMT=code, GROUP=group_size, BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=block_k, DOT_DTYPE=dot_dtype,
                  DOT_PRECISION="ieee" if dot_dtype == tl.float32 else None)  # no TF32
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, 64))](
        x, w13, s13, z13, *align, act,
        num_slots, inter, h,
        x.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1), s13.stride(2), act.stride(0),
        TOP_K=k, SCALE_N=rows13, **common,
    )
    _down_kernel[(num_blocks, triton.cdiv(h, 64))](
        act, w2, s2, z2, routing, *align, y,
        num_slots, h, inter,
        act.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), s2.stride(2), y.stride(0),
        SCALE_N=rows2, **common,
    )
    return y.view(t, k, h).sum(dim=1, dtype=torch.float32).to(x.dtype)


# ---------------------------------------------------------------- torch reference

def dequantize_experts_ref(w: torch.Tensor, fmt: str, scale: torch.Tensor | None = None,
                           zeros: torch.Tensor | None = None, group_size: int = 128,
                           in_features: int | None = None) -> torch.Tensor:
    """The float32 weights [E, N, K] of stacked experts `w` in format `fmt` (table above)."""
    if fmt in ("fp32", "bf16"):
        return w.float()
    if fmt == "fp8":
        rows = 1 if scale.shape[1] == w.shape[1] else 128
        return torch.stack([dequantize_fp8_blocks_ref(w[i], scale[i], (rows, FP8_SCALE_K)) for i in range(len(w))])
    k = in_features if in_features is not None else 2 * w.shape[2]
    return torch.stack([dequantize_int4_ref(w[i], scale[i], zeros[i], group_size, k) for i in range(len(w))])


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, *, fmt: str, w13_scale: torch.Tensor | None = None,
                  w2_scale: torch.Tensor | None = None, w13_zeros: torch.Tensor | None = None,
                  w2_zeros: torch.Tensor | None = None, group_size: int = 128) -> torch.Tensor:
    """Plain-torch `fused_moe` (same arguments and checks): a loop over the experts that
    were hit, each dequantised and run as float32 GEMMs on its gathered tokens."""
    dims, _, _ = _check_args(x, w13, w2, topk_weights, topk_ids, fmt, w13_scale, w2_scale, w13_zeros, w2_zeros,
                             group_size)
    t, k, e, h, inter = dims
    out = torch.zeros(t, h, dtype=torch.float32, device=x.device)  # [T, H]
    flat = topk_ids.reshape(-1)  # [T*k]
    routing = topk_weights.reshape(-1).float()
    for expert in flat.unique().tolist():
        slots = (flat == expert).nonzero().squeeze(1)
        tokens = slots // k
        sl = slice(expert, expert + 1)
        w13_e = dequantize_experts_ref(w13[sl], fmt, None if w13_scale is None else w13_scale[sl],
                                       None if w13_zeros is None else w13_zeros[sl], group_size, h)[0]  # [2I, H]
        w2_e = dequantize_experts_ref(w2[sl], fmt, None if w2_scale is None else w2_scale[sl],
                                      None if w2_zeros is None else w2_zeros[sl], group_size, inter)[0]  # [H, I]
        gate, up = (x[tokens].float() @ w13_e.t()).split(inter, dim=1)
        act = (torch.nn.functional.silu(gate) * up).to(x.dtype).float()  # the kernel stores it in x's dtype
        y = ((act @ w2_e.t()) * routing[slots, None]).to(x.dtype).float()  # and each slot's output
        out.index_add_(0, tokens, y)
    return out.to(x.dtype)
