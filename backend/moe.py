"""The mixture-of-experts block of DeepSeek-V3 / Glm4Moe models: router, routed experts, shared experts.

    out = sum_j w[t, j] * expert_{ids[t, j]}(x[t])  +  shared(x[t])        x, out [T, H]

A `MoEBlock` is called like a `LinearOp` (``y = block(x)``, compute dtype in and out),
so a model holds one per phase and runs decode rows and prompt rows through blocks
in different weight formats, exactly as it does its linear layers.

Numerics:
- Router (`moe_router.py`): float32 always. The gate weight Wg [E, H] and the
  correction bias [E] are float32 and never quantised (transformers keeps them in
  float32 too); the routing weights stay float32.
- Routed experts (`moe_experts.py`): SwiGLU in one weight format (fp32, bf16, fp8,
  int4 of `weight_formats.py`). Dense GEMMs run in the weight's dtype (activations
  cast to it); FP8 is dequantised at load into the compute dtype on CPU; INT4 runs
  the bfloat16 CPU INT4 GEMM. Each slot's output is multiplied by its routing weight
  and the k choices summed in float32.
- Shared experts: one SwiGLU MLP of intermediate moe_intermediate_size *
  n_shared_experts (gate_up and down `LinearOp`s, usually in the experts' format),
  added unscaled (routed_scaling_factor applies to routed experts only); none when
  n_shared_experts is 0.
- The sum of routed and shared outputs is formed in float32 and rounded once to
  the compute dtype.

What is quantised by a target format: routed and shared expert weights; never the
gate or its bias.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from backend.layers.swiglu import swiglu
from backend.linear import LinearOp
from backend.moe_experts import RoutedExperts
from backend.moe_router import MoEConfig, Routing, route
from backend.weight_formats import StoredWeight, WeightFormat

__all__ = ["MoEBlock", "MoEConfig", "Routing", "route"]


class MoEBlock:
    """One MoE layer: y [T, H] = block(x [T, H]) in the compute dtype (see the module docstring)."""

    def __init__(self, cfg: MoEConfig, gate_weight: torch.Tensor, correction_bias: torch.Tensor | None,
                 experts: RoutedExperts, shared_gate_up: LinearOp | None = None,
                 shared_down: LinearOp | None = None, path: str | None = None) -> None:
        """gate_weight [E, H] and correction_bias [E] are kept in float32; the shared
        experts are both given or both None; `path` pins the routed experts' path
        (grouped, loop, fused; None: `RoutedExperts.default_path`)."""
        if experts.num_experts != cfg.num_experts:
            raise ValueError(f"{experts.num_experts} experts given, the config routes over {cfg.num_experts}")
        if tuple(gate_weight.shape) != (cfg.num_experts, experts.hidden_size):
            raise ValueError(f"gate weight {tuple(gate_weight.shape)}, expected [{cfg.num_experts}, "
                             f"{experts.hidden_size}]")
        if correction_bias is not None and tuple(correction_bias.shape) != (cfg.num_experts,):
            raise ValueError(f"correction bias {tuple(correction_bias.shape)}, expected [{cfg.num_experts}]")
        if (shared_gate_up is None) != (shared_down is None):
            raise ValueError("shared experts need both gate_up and down (or neither)")
        if path is not None and path not in experts.paths:
            raise ValueError(f"path {path!r} is not available here; available: {', '.join(experts.paths)}")
        self.cfg = cfg
        self.gate_weight = gate_weight.float().contiguous()  # [E, H]
        self.correction_bias = None if correction_bias is None else correction_bias.float().contiguous()  # [E]
        self.experts = experts
        self.shared_gate_up, self.shared_down = shared_gate_up, shared_down
        self.path = path

    @classmethod
    def build(cls, gate_weight: torch.Tensor, correction_bias: torch.Tensor | None, gate_up: torch.Tensor,
              down: torch.Tensor, shared_gate_up: torch.Tensor | None, shared_down: torch.Tensor | None,
              cfg: MoEConfig, fmt: WeightFormat, compute_dtype: torch.dtype,
              path: str | None = None) -> MoEBlock:
        """From dense tensors, quantised into `fmt` one expert at a time.

        gate_weight [E, H], correction_bias [E] | None, gate_up [E, 2I, H] (gate rows
        first), down [E, H, I], shared_gate_up [2Is, H] | None, shared_down [H, Is] | None;
        the tensors' device is the block's."""
        experts = [(fmt.quantize(gate_up[e]), fmt.quantize(down[e])) for e in range(gate_up.shape[0])]
        shared = None
        if shared_gate_up is not None and shared_down is not None:
            shared = (fmt.quantize(shared_gate_up), fmt.quantize(shared_down))
        return cls.from_stored(gate_weight, correction_bias, [g for g, _ in experts], [d for _, d in experts],
                               shared, cfg, fmt, compute_dtype, path)

    @classmethod
    def from_stored(cls, gate_weight: torch.Tensor, correction_bias: torch.Tensor | None,
                    gate_up: Sequence[StoredWeight], down: Sequence[StoredWeight],
                    shared: tuple[StoredWeight, StoredWeight] | None, cfg: MoEConfig, fmt: WeightFormat,
                    compute_dtype: torch.dtype, path: str | None = None) -> MoEBlock:
        """From weights already in `fmt` (what a loader reads or converts): per expert
        gate_up [2I, H] and down [H, I]; `shared` the (gate_up [2Is, H], down [H, Is])
        of the shared experts, or None."""
        experts = RoutedExperts(fmt, gate_up, down, compute_dtype)
        shared_ops = (None, None) if shared is None else tuple(fmt.linear(sw, None, compute_dtype) for sw in shared)
        return cls(cfg, gate_weight, correction_bias, experts, *shared_ops, path=path)

    @property
    def out_features(self) -> int:
        return self.experts.hidden_size

    @property
    def nbytes(self) -> int:
        """Bytes of weights held: gate, bias, routed and shared experts."""
        n = self.gate_weight.nbytes + (0 if self.correction_bias is None else self.correction_bias.nbytes)
        n += self.experts.nbytes
        if self.shared_gate_up is not None:
            n += self.shared_gate_up.nbytes + self.shared_down.nbytes
        return n

    def _gemv_ops(self) -> list[LinearOp] | None:
        """An expert's GEMMs and the shared expert's where a call of a few rows runs the routed experts on the
        loop or the grouped C call (`moe_experts.py`; both run those GEMMs' C GEMVs), else None."""
        if not self.experts.ops or not (self.experts.c_rows or self.experts.default_path(1) == "loop"):
            return None
        return [op for op in (*self.experts.ops[0], self.shared_gate_up, self.shared_down) if op is not None]

    @property
    def gemv(self) -> bool:
        """Whether a call of a few rows runs every GEMM of the block on a C kernel (as `Linear.gemv` and
        `Int4Linear.gemv` say of a linear): routed experts whose default path runs C GEMVs (the loop of INT4
        experts, the grouped C call of dense ones, `moe_experts.py`) and a shared expert on them too. The engine
        then hands small steps' threads to the C kernels."""
        ops = self._gemv_ops()
        return ops is not None and all(getattr(op, "gemv", False) for op in ops)

    @property
    def gemv_rows(self) -> int:
        """Rows up to which every GEMM of a call runs the C GEMV (0: not all of them have one); an expert gets
        at most as many rows as the call."""
        return min(op.gemv_rows for op in self._gemv_ops()) if self.gemv else 0

    def route(self, x: torch.Tensor) -> Routing:
        """Which experts each row of x [T, H] goes to, and their weights (float32)."""
        return route(x, self.gate_weight, self.correction_bias, self.cfg)

    def __call__(self, x: torch.Tensor, path: str | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H] in x's dtype; `path` overrides the block's for this call."""
        if x.shape[0] == 0:
            return x.new_zeros(0, self.out_features)
        ids, weights = self.route(x)
        out = self.experts(x, ids, weights, path or self.path)  # [T, H] float32
        if self.shared_gate_up is not None:
            out += self.shared_down(swiglu(self.shared_gate_up(x))).float()
        return out.to(x.dtype)
