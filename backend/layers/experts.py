"""A mixture-of-experts layer read from a checkpoint into `backend.moe.MoEBlock`s, one per
target weight format (the router gate stays float32 and is shared by them).

Checkpoint names under `<prefix>mlp.` (Hugging Face, DeepSeek-V3 / Glm4Moe):

    gate.weight                       [E, H]    router, kept float32 (never quantised)
    gate.e_score_correction_bias      [E]       selection-only bias (absent: zero)
    experts.{j}.{gate,up}_proj.weight [I, H]    per expert (what save_pretrained and the
    experts.{j}.down_proj.weight      [H, I]    public checkpoints hold); FP8 checkpoints add
                                                `.weight_scale_inv` block scales
    experts.gate_up_proj              [E, 2I, H] or the fused form newer transformers uses
    experts.down_proj                 [E, H, I]  in memory (gate rows first, then up)
    shared_experts.{gate,up,down}_proj.weight    one SwiGLU MLP of I * n_shared_experts

Experts in any stored format are dequantised to float32 one expert at a time and
stacked; `MoEBlock.build` then makes each target format from them.
"""

from __future__ import annotations

import torch

from backend.layers.loader import WeightLoader
from backend.moe import MoEBlock, MoEConfig

__all__ = ["load_moe", "moe_config"]


def moe_config(loader: WeightLoader) -> MoEConfig:
    cfg = loader.cfg
    return MoEConfig(num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok, n_group=cfg.n_group,
                     topk_group=cfg.topk_group, norm_topk_prob=cfg.norm_topk_prob,
                     routed_scaling_factor=cfg.routed_scaling_factor)


def _experts(loader: WeightLoader, p: str) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [E, 2I, H] and down [E, H, I] in float32, from per-expert or fused names."""
    cfg = loader.cfg
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    if f"{p}experts.gate_up_proj" in loader:
        gate_up, down = (loader.ckpt.get(f"{p}experts.{n}").float() for n in ("gate_up_proj", "down_proj"))
        if gate_up.shape != (e, 2 * i, h) or down.shape != (e, h, i):
            from backend.errors import WeightsError

            raise WeightsError(f"{p}experts has gate_up {list(gate_up.shape)} / down {list(down.shape)}, the config "
                               f"needs {[e, 2 * i, h]} / {[e, h, i]}", tensor=f"{p}experts.gate_up_proj")
        return gate_up, down
    gate_up = torch.empty(e, 2 * i, h)  # [E, 2I, H]
    down = torch.empty(e, h, i)  # [E, H, I]
    for j in range(e):
        q = f"{p}experts.{j}."
        gate_up[j, :i] = loader.read_dense(f"{q}gate_proj", (i, h))
        gate_up[j, i:] = loader.read_dense(f"{q}up_proj", (i, h))
        down[j] = loader.read_dense(f"{q}down_proj", (h, i))
    return gate_up, down


def load_moe(loader: WeightLoader, prefix: str) -> dict[str, MoEBlock]:
    """One MoEBlock per target format for the MoE layer at `<prefix>mlp.`."""
    cfg = loader.cfg
    p = f"{prefix}mlp."
    dev = loader.device
    gate_weight = loader.ckpt.get(f"{p}gate.weight").float().to(dev)  # [E, H]
    bias_name = f"{p}gate.e_score_correction_bias"
    bias = loader.ckpt.get(bias_name).float().to(dev) if bias_name in loader else None  # [E]
    gate_up, down = (t.to(dev) for t in _experts(loader, p))
    shared_gate_up = shared_down = None
    if cfg.n_shared_experts:
        h, i_s = cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts
        s = f"{p}shared_experts."
        shared_gate_up = torch.cat([loader.read_dense(f"{s}gate_proj", (i_s, h)),
                                    loader.read_dense(f"{s}up_proj", (i_s, h))]).to(dev)  # [2 Is, H]
        shared_down = loader.read_dense(f"{s}down_proj", (h, i_s)).to(dev)  # [H, Is]
    mcfg = moe_config(loader)
    return {key: MoEBlock.build(gate_weight, bias, gate_up, down, shared_gate_up, shared_down, mcfg, fmt,
                                loader.dtype)
            for key, fmt in loader.targets.items()}
