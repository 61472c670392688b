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

Experts are converted one expert at a time from their stored format into each target
format (`WeightLoader.convert`: as stored when the formats agree, so an FP8 checkpoint
served in FP8 is never widened), and `MoEBlock.from_stored` takes them as they are: peak
extra memory at load is one expert in float32, not a layer's experts (a GLM-4.6 layer's
160 experts would be 15 GB in float32).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from backend.errors import WeightsError
from backend.layers.loader import WeightLoader
from backend.moe import MoEBlock, MoEConfig
from backend.weight_formats import DenseFormat, StoredWeight, WeightFormat

__all__ = ["load_moe", "moe_config"]


def moe_config(loader: WeightLoader) -> MoEConfig:
    cfg = loader.cfg
    return MoEConfig(num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok, n_group=cfg.n_group,
                     topk_group=cfg.topk_group, norm_topk_prob=cfg.norm_topk_prob,
                     routed_scaling_factor=cfg.routed_scaling_factor)


_Stored = tuple[WeightFormat, StoredWeight]


def _expert_weights(loader: WeightLoader, p: str) -> Iterator[tuple[list[_Stored], _Stored]]:
    """Per expert, one at a time: its gate_up parts ([gate [I, H], up [I, H]], or the fused [2I, H])
    and down [H, I] as stored, from per-expert or fused checkpoint names."""
    cfg = loader.cfg
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    if f"{p}experts.gate_up_proj" in loader:
        gate_up, down = (loader.ckpt.get(f"{p}experts.{n}") for n in ("gate_up_proj", "down_proj"))
        if gate_up.shape != (e, 2 * i, h) or down.shape != (e, h, i):
            raise WeightsError(f"{p}experts has gate_up {list(gate_up.shape)} / down {list(down.shape)}, the config "
                               f"needs {[e, 2 * i, h]} / {[e, h, i]}", tensor=f"{p}experts.gate_up_proj")
        src = DenseFormat(gate_up.dtype)
        for j in range(e):
            yield [(src, src.quantize(gate_up[j]))], (src, src.quantize(down[j]))
        return
    for j in range(e):
        q = f"{p}experts.{j}."
        yield [loader.read(f"{q}gate_proj", (i, h)), loader.read(f"{q}up_proj", (i, h))], \
            loader.read(f"{q}down_proj", (h, i))


def _on(sw: StoredWeight, device: torch.device | str) -> StoredWeight:
    return StoredWeight({k: t.to(device) for k, t in sw.tensors.items()}, sw.shape)


def load_moe(loader: WeightLoader, prefix: str) -> dict[str, MoEBlock]:
    """One MoEBlock per target format for the MoE layer at `<prefix>mlp.`."""
    cfg = loader.cfg
    p = f"{prefix}mlp."
    dev = loader.device
    gate_weight = loader.ckpt.get(f"{p}gate.weight").float().to(dev)  # [E, H]
    bias_name = f"{p}gate.e_score_correction_bias"
    bias = loader.ckpt.get(bias_name).float().to(dev) if bias_name in loader else None  # [E]
    targets = loader.targets
    gate_ups: dict[str, list[StoredWeight]] = {key: [] for key in targets}
    downs: dict[str, list[StoredWeight]] = {key: [] for key in targets}
    for gate_up_parts, (down_src, down_sw) in _expert_weights(loader, p):
        for key, fmt in targets.items():
            parts = [loader.convert(src, sw, fmt) for src, sw in gate_up_parts]
            gate_ups[key].append(_on(fmt.cat_rows(parts) if len(parts) > 1 else parts[0], dev))  # [2I, H]
            downs[key].append(_on(loader.convert(down_src, down_sw, fmt), dev))  # [H, I]
    shared: dict[str, tuple[StoredWeight, StoredWeight] | None] = dict.fromkeys(targets)
    if cfg.n_shared_experts:
        h, i_s = cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts
        s = f"{p}shared_experts."
        parts = [loader.read(f"{s}gate_proj", (i_s, h)), loader.read(f"{s}up_proj", (i_s, h))]
        down_part = loader.read(f"{s}down_proj", (h, i_s))
        for key, fmt in targets.items():
            shared_gate_up = fmt.cat_rows([loader.convert(src, sw, fmt) for src, sw in parts])  # [2 Is, H]
            shared[key] = (_on(shared_gate_up, dev), _on(loader.convert(*down_part, fmt), dev))  # [H, Is]
    mcfg = moe_config(loader)
    return {key: MoEBlock.from_stored(gate_weight, bias, gate_ups[key], downs[key], shared[key], mcfg, fmt,
                                      loader.dtype)
            for key, fmt in targets.items()}
