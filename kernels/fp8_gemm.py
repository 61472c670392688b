"""W8A16 GEMM: y = x @ W.T with FP8 (e4m3) weights and block scales applied in registers.

Reads the FP8 layout defined (with its numerics) in `backend/weight_formats.py`:

    w      float8_e4m3fn [N, K]
    scale  float32 [ceil(N / SCALE_N), ceil(K / SCALE_K)]      (`weight_scale_inv`)
    W[n, k] = float(w[n, k]) * scale[n // SCALE_N, k // SCALE_K]

SCALE_N x SCALE_K is 128 x 128 in checkpoints (the public FP8 layout) and 1 x 128 once
the runtime has expanded the scales per row (to reorder or fuse rows at load).
`quantize_fp8_blocks_ref` / `dequantize_fp8_blocks_ref` here are the format's one
implementation.

Tiled GEMM: grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)); each program loops over K in
BLOCK_K tiles (BLOCK_K divides SCALE_K, so a tile needs one scale per row), loads the FP8
tile, converts it (exactly) to float32, multiplies by the per-row scales and feeds
`tl.dot` in x's dtype with a float32 accumulator. It is the prefill GEMM: M is a chunk
of prompt tokens. (On Hopper a native FP8 x FP8 dot would also quantise activations;
this kernel keeps activations in 16 bits, W8A16.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.exact_div import div_exact
from kernels.paged_attention import _dot_dtype

__all__ = ["fp8_gemm", "fp8_gemm_ref", "quantize_fp8_blocks_ref", "dequantize_fp8_blocks_ref", "FP8_MAX"]

FP8_MAX = 448.0  # largest finite float8_e4m3fn


# ---------------------------------------------------------------- kernel

@triton.jit
def _fp8_gemm_kernel(
    # pointers
    x_ptr,  # [M, K]
    w_ptr,  # [N, K] float8_e4m3fn
    s_ptr,  # [ceil(N / SCALE_N), ceil(K / SCALE_K)] float32
    y_ptr,  # [M, N]
    # sizes
    M, N, K,
    # strides
    stride_xm, stride_wn, stride_sn, stride_sk, stride_ym,
    # meta-parameters
    SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One program per [BLOCK_M, BLOCK_N] output tile, looping over K."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    scale_rows = s_ptr + (offs_n // SCALE_N) * stride_sn  # [BLOCK_N] pointers
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
                    mask=mask_n[:, None] & mask_k[None, :], other=0.0)  # [BLOCK_N, BLOCK_K] fp8
        scale = tl.load(scale_rows + (k0 // SCALE_K) * stride_sk, mask=mask_n, other=0.0)  # [BLOCK_N]
        w = w.to(tl.float32) * scale[:, None]
        acc += tl.dot(x.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), input_precision=DOT_PRECISION)
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


# ---------------------------------------------------------------- launcher

def _check_scale(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> None:
    """The scale grid must cover w in `block` = (rows, columns) per scale, powers of two."""
    bn, bk = block
    n, k = w.shape
    want = (-(-n // bn), -(-k // bk))
    if bn < 1 or bn & (bn - 1) or bk < 16 or bk & (bk - 1):
        raise ValueError(f"scale block must be powers of two (columns >= 16), got {block}")
    if tuple(scale.shape) != want or scale.dtype != torch.float32:
        raise ValueError(f"scale must be float32 {list(want)} for a {list(w.shape)} weight in {bn}x{bk} blocks, "
                         f"got {tuple(scale.shape)} {scale.dtype}")


def fp8_gemm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128)
             ) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W.T in x's dtype, W the FP8 weight with `block` = (SCALE_N, SCALE_K)."""
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or x.stride(1) != 1:
        raise ValueError(f"x must be [M, K] float32/bfloat16/float16 with contiguous rows, got "
                         f"{tuple(x.shape)} {x.dtype}")
    if w.dim() != 2 or w.dtype != torch.float8_e4m3fn or w.shape[1] != x.shape[1] or w.stride(1) != 1:
        raise ValueError(f"w must be float8_e4m3fn [N, {x.shape[1]}] with contiguous rows, got "
                         f"{tuple(w.shape)} {w.dtype}")
    if not (x.device == w.device == scale.device):
        raise ValueError("x, w and scale must be on one device")
    _check_scale(w, scale, block)
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    dot_dtype = _dot_dtype(x.dtype) if x.dtype != torch.float16 else tl.float16
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    _fp8_gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, 64))](
        x, w, scale, y,
        m, n, k,
        x.stride(0), w.stride(0), scale.stride(0), scale.stride(1), y.stride(0),
        SCALE_N=block[0], SCALE_K=block[1], BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=min(64, block[1]),
        DOT_DTYPE=dot_dtype, DOT_PRECISION="ieee" if dot_dtype == tl.float32 else None,  # no TF32
    )
    return y


# ---------------------------------------------------------------- torch reference and the format itself

def _blocked(t: torch.Tensor, block: tuple[int, int], fill: float = 0.0) -> torch.Tensor:
    """[N, K] -> [N/bn, bn, K/bk, bk] after padding N and K up with `fill`."""
    bn, bk = block
    n, k = t.shape
    padded = torch.nn.functional.pad(t, (0, -k % bk, 0, -n % bn), value=fill)
    return padded.view(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)


def quantize_fp8_blocks_ref(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """Float [N, K] -> (float8_e4m3fn [N, K], float32 scale [ceil(N/bn), ceil(K/bk)]), s = amax / 448."""
    n, k = w.shape
    blocks = _blocked(w.float(), block)
    amax = blocks.abs().amax(dim=(1, 3))  # [N/bn, K/bk]
    scale = torch.where(amax > 0, div_exact(amax, FP8_MAX), 1.0)  # alike on every device
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.view(blocks.shape[0] * block[0], -1)[:n, :k].to(torch.float8_e4m3fn)
    return q.contiguous(), scale.contiguous()


def dequantize_fp8_blocks_ref(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128)
                              ) -> torch.Tensor:
    """The float32 weight [N, K]; `block` = (rows, columns) per scale."""
    n, k = w.shape
    s = scale.repeat_interleave(block[0], dim=0)[:n].repeat_interleave(block[1], dim=1)[:, :k]
    return w.float() * s


def fp8_gemm_ref(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128)
                 ) -> torch.Tensor:
    """Plain-torch `fp8_gemm`: dequantise, then one float32 GEMM; returns x's dtype."""
    _check_scale(w, scale, block)
    return (x.float() @ dequantize_fp8_blocks_ref(w, scale, block).t()).to(x.dtype)
