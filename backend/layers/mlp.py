"""The dense SwiGLU MLP: down(silu(gate(x)) * up(x)), gate and up fused into one GEMM.

    x [T, hidden] -> gate_up [T, 2 * intermediate] -> silu(gate) * up [T, intermediate] -> down [T, hidden]
"""

from __future__ import annotations

import torch

from backend.layers.attention import run_linear
from backend.layers.loader import WeightLoader
from backend.layers.swiglu import swiglu
from backend.linear import LinearOp

__all__ = ["load_mlp", "mlp"]


def load_mlp(loader: WeightLoader, prefix: str, intermediate: int) -> tuple[dict[str, LinearOp], dict[str, LinearOp]]:
    """Per target format, the fused `<prefix>{gate,up}_proj` [2 * intermediate, hidden] and
    `<prefix>down_proj` [hidden, intermediate] linears."""
    hidden = loader.cfg.hidden_size
    gate_up = loader.linears([(f"{prefix}gate_proj", (intermediate, hidden), 0),
                              (f"{prefix}up_proj", (intermediate, hidden), 0)])
    down = loader.linears([(f"{prefix}down_proj", (hidden, intermediate), 0)])
    return gate_up, down


def mlp(gate_up: LinearOp, decode_gate_up: LinearOp, down: LinearOp, decode_down: LinearOp,
        x: torch.Tensor, split: int) -> torch.Tensor:
    """The MLP output [T, hidden] of x [T, hidden]; decode rows per `run_linear`."""
    return run_linear(down, decode_down, swiglu(run_linear(gate_up, decode_gate_up, x, split)), split)
