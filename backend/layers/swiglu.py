"""SwiGLU's activation: silu(gate) * up for h = [gate | up] [T, 2I], as the dense MLP, the MoE experts and
the shared experts compute it.

On the CPU a bfloat16 h is one C call (`kernels/cpu_silu_mul.py`: torch's two roundings, its bits but on
bfloat16 rounding boundaries, one step there); elsewhere torch's `F.silu(gate).mul_(up)`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpu_silu_mul import silu_mul_bf16

__all__ = ["swiglu"]


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up [T, I] for h = [gate | up] [T, 2I] (a new tensor; h is left as it is)."""
    out = silu_mul_bf16(h)  # None where the kernel does not take h (not bfloat16 on the CPU, ...)
    if out is not None:
        return out
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)
