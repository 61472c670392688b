"""AWQ-style activation-aware scaling: per-input-channel scales searched per layer, folded away exactly.

A linear y = x Wᵀ is unchanged when its input channel k is divided by s_k and W's column k
multiplied by it: y = (x / s)(W diag s)ᵀ. Quantisation is not: channels with large
activations (large mean |x_k|) multiply their weights' rounding errors by large values,
and scaling those columns up before rounding makes their relative error smaller, at the
cost of the other columns in the same group (Lin et al., 2023, "AWQ"). For a group of
linears that read the same input x [n, K]:

    s(α) = m^α / sqrt(max m^α · min m^α),   m_k = mean |x_k| (clamped to ≥ 1e-4)
    Q_α  = RTN(W diag s(α)) diag s(α)⁻¹          # the weight the quantised model computes with
    err(α) = Σ_rows (W - Q_α) H (W - Q_α)ᵀ,   H = Xᵀ X   # = ||X Wᵀ - X Q_αᵀ||², the output error
    α* = argmin over α in 0, 1/grid, .., 1

with RTN on the target's grid (`fake_quant`: the asymmetric bfloat16 scale/zero grid or
compressed-tensors' symmetric one, as `ops/gptq.py` defines them). α = 0 is s = 1, the
unscaled weight, so the search never picks scales whose RTN output error is worse than
none. The error is evaluated through H (K × K) rather than the activations, so each
candidate costs one [N, K] × [K, K] product whatever the number of calibration tokens.

**Where the scales go** (exact, `ops/calibration.py` decides per layer):

- into the RMSNorm that produces x (``norm.weight / s``, stored in the norm's dtype; the
  scales applied to W are then the ones the rounded norm weight realises,
  ``s_eff = w / bfloat16(w / s)``, so x / s_eff is what the runtime computes): q/k/v after
  ``input_layernorm``, a dense MLP's gate/up after ``post_attention_layernorm`` (not in MoE
  layers, where the router reads the same norm's output);
- into the previous linear's output rows: down_proj's input silu(g) ⊙ u scales with up_proj's
  rows, so ``up.rows / s`` and ``down.columns · s`` (every dense MLP, routed and shared expert).

The scaled weights are then quantised by GPTQ (`edgeserve quantize --method gptq --awq`) or
rounded to nearest (``--method awq``) against the scaled inputs. On SmolLM2 g128 (BENCHMARKS.md)
AWQ + RTN closes most of RTN's loss, and AWQ before GPTQ gains nothing over GPTQ alone over
20k held-out tokens. o_proj's inputs could take scales folded into v_proj's rows (tied across
a kv head's query heads under GQA); measured worse, that fold is not made. Only where every linear reading x is quantised: a linear an
ignore list keeps dense would have to be written scaled, so such groups are left unscaled.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

__all__ = ["AwqScales", "DEFAULT_GRID", "fake_quant", "search_scales", "fold_into_norm", "input_stats"]

DEFAULT_GRID = 20  # α in 0, 0.05, .., 1
_M_MIN = 1e-4  # floor of mean |x_k|: a channel that is always ~0 gets a finite scale


class AwqScales(NamedTuple):
    scales: torch.Tensor  # [K] float32: column k of W is multiplied by scales[k], input k divided by it
    alpha: float  # the exponent chosen
    error: float  # the output error err(alpha) of RTN on the scaled weights
    error_unscaled: float  # err(0): RTN without scaling


def fake_quant(group_size: int, symmetric: bool, integer_zero: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
    """RTN on the INT4 grid, dequantised: w [N, K] -> [N, K] float32, group-wise along K (a last
    partial group allowed), bit for bit `ops.gptq`'s grids (asymmetric bfloat16 s, z; symmetric; or
    `integer_zero`, compressed-tensors' asymmetric one)."""
    from ops.gptq import _codes, _grid

    params = _grid(symmetric, integer_zero)

    def quantise(w: torch.Tensor) -> torch.Tensor:
        w = w.float()
        out = torch.empty_like(w)
        for j in range(0, w.shape[1], group_size):
            wg = w[:, j:j + group_size]
            s, z = params(wg)
            out[:, j:j + group_size] = (_codes(wg, s[:, None], z[:, None], symmetric) - 8) * s[:, None] + z[:, None]
        return out

    return quantise


def input_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(H = Xᵀ X [K, K] float32, mean |x_k| [K] float32) of inputs x [..., K]."""
    flat = x.reshape(-1, x.shape[-1]).float()
    return flat.t() @ flat, flat.abs().mean(dim=0)


def search_scales(h: torch.Tensor, mean_abs: torch.Tensor, weights: list[torch.Tensor],
                  quantise: Callable[[torch.Tensor], torch.Tensor], grid: int = DEFAULT_GRID) -> AwqScales:
    """The α (and its scales [K]) whose RTN output error over `weights` (each [N_i, K], reading the
    inputs of Gram matrix `h` [K, K] and mean |x| `mean_abs` [K]) is least (module docstring)."""
    from ops.gptq import _one_thread

    with _one_thread():  # many small ops: a second intra-op thread only adds synchronisation (ops/gptq.py)
        return _search(h, mean_abs, weights, quantise, grid)


def _search(h: torch.Tensor, mean_abs: torch.Tensor, weights: list[torch.Tensor],
            quantise: Callable[[torch.Tensor], torch.Tensor], grid: int) -> AwqScales:
    w = torch.cat([t.float() for t in weights])  # [N, K]
    h = h.float()
    m = mean_abs.float().clamp(min=_M_MIN)
    best: AwqScales | None = None
    unscaled = 0.0
    for i in range(grid + 1):
        alpha = i / grid
        s = m.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        e = w - quantise(w * s) / s  # [N, K]: the effective weight's error
        err = float(((e @ h) * e).sum())
        if i == 0:
            unscaled = err
        if best is None or err < best.error:
            best = AwqScales(s, alpha, err, unscaled)
    assert best is not None
    return best._replace(error_unscaled=unscaled)


def fold_into_norm(norm_weight: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm_weight / scales in the norm's dtype, the scales that rounded weight realises [K] float32).
    A zero norm weight keeps scale 1 (its channel is zero either way)."""
    w = norm_weight.float()
    new = (w / scales).to(norm_weight.dtype)
    nonzero = (w != 0) & (new.float() != 0)
    s_eff = torch.where(nonzero, w / torch.where(nonzero, new.float(), 1.0), 1.0)
    new = torch.where(nonzero, new, norm_weight)
    return new, s_eff
