"""RMSNorm as the reference computes it: in float32, cast back, then scaled.

    y = weight * (x / sqrt(mean(x^2) + eps))

Over the last dim, so the same function normalises whole rows ([T, hidden]) and
single heads ([T, heads, head_dim], Glm4Moe's q/k norm, whose weight [heads, head_dim]
or [head_dim] broadcasts).

bfloat16 rows with a one-row weight on the CPU take one C call (`kernels/cpu_rms_norm.py`:
the same arithmetic and roundings, ~6 µs where the four torch ops took ~18-21 µs at one
row of 576); everything else runs the torch ops below. `add_rms_norm` is a decoder layer's
`h += branch; x = rms_norm(h)`, one C call for such rows as well.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpu_rms_norm import add_rms_norm_bf16, rms_norm_bf16

__all__ = ["rms_norm", "add_rms_norm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x over its last dim, times `weight` (broadcast), in x's dtype."""
    if x.dtype == torch.float32 and weight.shape == x.shape[-1:]:  # one fused op
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    if x.dtype == torch.bfloat16 and (y := rms_norm_bf16(x, weight, eps)) is not None:  # CPU, one-row weight
        return y
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`h.add_(delta)` (the residual stream, in place), then `rms_norm(h, weight, eps)`."""
    if h.dtype == torch.bfloat16 and (y := add_rms_norm_bf16(h, delta, weight, eps)) is not None:
        return y
    h.add_(delta)
    return rms_norm(h, weight, eps)
