"""Division by a constant that rounds alike on every device: the quantisers' scales (FP8 amax / 448, INT4
(hi - lo) / 15) must come out bit for bit the same whether a weight or a KV row is quantised on the CPU or a GPU.

CUDA divides a tensor by a Python scalar as a product with the scalar's reciprocal, which is an ulp off the
correctly rounded quotient for some inputs (seen on an H200: FP8 scales an ulp apart, so an e4m3 code, or an INT4
scale after its bfloat16 rounding, could differ from the CPU's). A tensor divisor is a true, correctly rounded
division on both devices; on the CPU the result is what dividing by the scalar gave.
"""

from __future__ import annotations

import torch

__all__ = ["div_exact"]


def div_exact(t: torch.Tensor, divisor: float) -> torch.Tensor:
    """t / divisor, correctly rounded in t's dtype on any device (module docstring)."""
    return t / torch.full_like(t, divisor)
