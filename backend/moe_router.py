"""The MoE router: which experts each token goes to, and with what weight.

The router of DeepSeek-V3, Kimi K2 and GLM-4.5 onwards (``noaux_tc`` top-k), computed
in float32 whatever the compute dtype, with the gate weight Wg [E, H] never quantised:

    s = sigmoid(x · Wgᵀ)                                     # [T, E] affinity per expert
    c = s + e_score_correction_bias                          # for *selection* only
    group score = sum of the top-2 of c in each of n_group equal groups of experts
    keep the topk_group best groups; experts of the others cannot be picked
    topk_ids = top_k of c over the kept experts
    w = s[topk_ids]                                          # unbiased scores
    w = w / (sum(w) + 1e-20)     if norm_topk_prob
    topk_weights = w · routed_scaling_factor

The correction bias is learned load balancing (no auxiliary loss): it moves which
experts are chosen, never how much they contribute. Masked experts are filled with
-inf before the top-k, so they cannot be chosen even when c is negative elsewhere.
Ties are broken as `torch.topk` breaks them (the reference implementation makes the
same calls, so the two agree id for id).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

__all__ = ["MoEConfig", "Routing", "route"]


@dataclass(frozen=True)
class MoEConfig:
    """What the router and the MoE block need to know of a model's config."""

    num_experts: int  # routed experts E (config.json: n_routed_experts / num_local_experts)
    top_k: int  # experts per token (num_experts_per_tok)
    n_group: int = 1  # expert groups for group-limited routing
    topk_group: int = 1  # groups a token may pick experts from
    norm_topk_prob: bool = True  # renormalise the chosen weights to sum to 1
    routed_scaling_factor: float = 1.0  # multiplies the routed weights (not the shared experts)

    def __post_init__(self) -> None:
        e, g = self.num_experts, self.n_group
        if e < 1 or g < 1 or e % g:
            raise ValueError(f"num_experts {e} must be a positive multiple of n_group {g}")
        if g > 1 and e // g < 2:
            raise ValueError(f"group-limited routing scores a group by its top-2 experts; {e} experts in "
                             f"{g} groups leaves {e // g} per group")
        if not 1 <= self.topk_group <= g:
            raise ValueError(f"topk_group {self.topk_group} must be in 1..n_group ({g})")
        if not 1 <= self.top_k <= self.topk_group * (e // g):
            raise ValueError(f"top_k {self.top_k} must be in 1..{self.topk_group * (e // g)} "
                             f"(the experts of {self.topk_group} of {g} groups)")

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> MoEConfig:
        """From a config.json dict (Glm4Moe, DeepSeek-V3 field names)."""
        experts = config.get("n_routed_experts", config.get("num_local_experts"))
        if experts is None:
            raise ValueError("config.json names no routed experts (n_routed_experts / num_local_experts)")
        return cls(num_experts=int(experts), top_k=int(config["num_experts_per_tok"]),
                   n_group=int(config.get("n_group") or 1), topk_group=int(config.get("topk_group") or 1),
                   norm_topk_prob=bool(config.get("norm_topk_prob", True)),
                   routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)))


class Routing(NamedTuple):
    """The router's answer for T tokens."""

    topk_ids: torch.Tensor  # [T, top_k] int64 expert ids, distinct within a row
    topk_weights: torch.Tensor  # [T, top_k] float32, what each chosen expert's output is multiplied by


def route(x: torch.Tensor, gate_weight: torch.Tensor, correction_bias: torch.Tensor | None,
          cfg: MoEConfig) -> Routing:
    """Route T tokens x [T, H] (any float dtype) over cfg.num_experts experts.

    gate_weight [E, H] and correction_bias [E] (None: zero) are used in float32;
    the selection rule is in the module docstring."""
    t, e = x.shape[0], cfg.num_experts
    if gate_weight.shape != (e, x.shape[1]):
        raise ValueError(f"gate weight {tuple(gate_weight.shape)} does not fit {e} experts x hidden {x.shape[1]}")
    scores = F.linear(x.float(), gate_weight.float()).sigmoid()  # [T, E]
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if cfg.topk_group < cfg.n_group:
        per_group = choice.view(t, cfg.n_group, e // cfg.n_group)  # [T, G, E/G]
        group_scores = per_group.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        kept = group_scores.topk(cfg.topk_group, dim=-1, sorted=False).indices  # [T, topk_group]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        choice = per_group.masked_fill(~group_mask.unsqueeze(-1), float("-inf")).view(t, e)
    topk_ids = choice.topk(cfg.top_k, dim=-1, sorted=False).indices  # [T, k]
    weights = scores.gather(1, topk_ids)  # [T, k]
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return Routing(topk_ids, weights * cfg.routed_scaling_factor)
