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
served in FP8 is never widened, and Kimi's compressed-tensors INT4 experts stay the
stored INT4 codes), and the MoE block takes them as they are: peak extra memory at load
is one expert in float32, not a layer's experts (a GLM-4.6 layer's 160 experts would be
15 GB in float32).

Where the target is the checkpoint's own format, weights the quantiser left dense stay
dense in the compute dtype (`WeightLoader.target_format`): Kimi's INT4 checkpoints
quantise the routed experts only, so the shared experts stay BF16 beside INT4 routed
ones. The routed experts take one format per target, decided by expert 0 (a later
expert stored otherwise is converted into it).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from backend.errors import WeightsError
from backend.layers.loader import WeightLoader
from backend.moe import MoEBlock, MoEConfig
from backend.moe_experts import RoutedExperts
from backend.linear import LinearOp
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
    fmts: dict[str, WeightFormat] = {}  # target -> the routed experts' format (expert 0 decides)
    gate_ups: dict[str, list[StoredWeight]] = {key: [] for key in targets}
    downs: dict[str, list[StoredWeight]] = {key: [] for key in targets}
    for gate_up_parts, (down_src, down_sw) in _expert_weights(loader, p):
        for key, dst in targets.items():
            fmt = fmts.setdefault(key, loader.target_format([src for src, _ in gate_up_parts] + [down_src], dst))
            parts = [loader.convert(src, sw, fmt) for src, sw in gate_up_parts]
            gate_ups[key].append(_on(fmt.cat_rows(parts) if len(parts) > 1 else parts[0], dev))  # [2I, H]
            downs[key].append(_on(loader.convert(down_src, down_sw, fmt), dev))  # [H, I]
    shared: dict[str, tuple[LinearOp, LinearOp] | tuple[None, None]] = {key: (None, None) for key in targets}
    if cfg.n_shared_experts:
        h, i_s = cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts
        s = f"{p}shared_experts."
        parts = [loader.read(f"{s}gate_proj", (i_s, h)), loader.read(f"{s}up_proj", (i_s, h)),
                 loader.read(f"{s}down_proj", (h, i_s))]
        for key, dst in targets.items():
            fmt = loader.target_format([src for src, _ in parts], dst)
            gate_up, down = fmt.cat_rows([loader.convert(src, sw, fmt) for src, sw in parts[:2]]), \
                loader.convert(*parts[2], fmt)  # [2 Is, H], [H, Is]
            shared[key] = (fmt.linear(_on(gate_up, dev), None, loader.dtype),
                           fmt.linear(_on(down, dev), None, loader.dtype))
    mcfg = moe_config(loader)
    return {key: MoEBlock(mcfg, gate_weight, bias, RoutedExperts(fmts[key], gate_ups[key], downs[key], loader.dtype),
                          *shared[key])
            for key in targets}
