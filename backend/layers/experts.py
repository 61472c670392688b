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

Tensor and expert parallelism (a loader with a `ShardPlan`): without expert parallelism
each rank holds every routed expert's slice of intermediate rows (gate/up rows,
down columns), like a dense MLP; with it, rank r holds whole experts
[r E / N, (r + 1) E / N) (`ExpertShard`) and reads no other expert's tensors. Shared
experts are tensor-parallel in both cases. Dispatch and combine: attention is
tensor-parallel, so after its all-reduce every rank already holds every token of the
step; each rank routes all of them (the router is replicated, float32, so every rank
picks the same experts), runs only the slots of its own experts, and the partial
outputs are combined by the one all-reduce the layer makes anyway (routed and shared
partial sums together). That all-reduce *is* the reduce-scatter + all-gather pair; an
all-to-all would send each token only to its experts' ranks, which pays off only when
ranks hold different tokens (data-parallel attention), not here.
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

__all__ = ["ExpertShard", "load_moe", "moe_config"]


def moe_config(loader: WeightLoader) -> MoEConfig:
    cfg = loader.cfg
    return MoEConfig(num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok, n_group=cfg.n_group,
                     topk_group=cfg.topk_group, norm_topk_prob=cfg.norm_topk_prob,
                     routed_scaling_factor=cfg.routed_scaling_factor)


_Stored = tuple[WeightFormat, StoredWeight]


def _expert_weights(loader: WeightLoader, p: str) -> Iterator[tuple[list[_Stored], _Stored]]:
    """Per expert this rank holds, one at a time: its gate_up parts ([gate [I, H], up [I, H]], or
    the fused [2I, H]) and down [H, I] as stored (this rank's rows of them under tensor
    parallelism), from per-expert or fused checkpoint names."""
    cfg, whole = loader.cfg, loader.global_cfg
    h, i = cfg.hidden_size, cfg.moe_intermediate_size  # i: this rank's rows of each expert
    plan = loader.plan
    held = plan.experts if plan is not None else range(cfg.num_experts)
    if f"{p}experts.gate_up_proj" in loader:
        e, i_all = whole.num_experts, whole.moe_intermediate_size
        names = [f"{p}experts.{n}" for n in ("gate_up_proj", "down_proj")]
        shapes = [loader.ckpt.spec(n).shape for n in names]
        if shapes[0] != (e, 2 * i_all, h) or shapes[1] != (e, h, i_all):
            raise WeightsError(f"{p}experts has gate_up {list(shapes[0])} / down {list(shapes[1])}, the config "
                               f"needs {[e, 2 * i_all, h]} / {[e, h, i_all]}", tensor=names[0])
        rows = range(0, i_all) if plan is None or plan.expert_parallel else \
            range(plan.rank * i, (plan.rank + 1) * i)  # this rank's intermediate rows of every expert
        for j in held:
            gate = loader.ckpt.get_region(names[0], [(j, j + 1), (rows.start, rows.stop)])[0]
            up = loader.ckpt.get_region(names[0], [(j, j + 1), (i_all + rows.start, i_all + rows.stop)])[0]
            down = loader.ckpt.get_region(names[1], [(j, j + 1), (0, h), (rows.start, rows.stop)])[0]
            src = DenseFormat(gate.dtype)
            yield [(src, src.quantize(gate)), (src, src.quantize(up))], (src, src.quantize(down))
        return
    for j in held:
        q = f"{p}experts.{j}."
        yield [loader.read(f"{q}gate_proj", (i, h)), loader.read(f"{q}up_proj", (i, h))], \
            loader.read(f"{q}down_proj", (h, i))


class ExpertShard:
    """An expert-parallel rank's routed experts [first, first + n): called like `RoutedExperts`
    with the global expert ids of every slot, it runs only the slots of its own experts and
    returns their weighted sum [T, H] float32 (zero rows for tokens routed elsewhere)."""

    def __init__(self, experts: RoutedExperts, first: int, num_experts: int) -> None:
        self.local = experts
        self.first, self.stop = first, first + experts.num_experts
        self.num_experts = num_experts  # routed experts of the whole layer (what the router picks from)
        self.hidden_size, self.intermediate_size = experts.hidden_size, experts.intermediate_size
        self.fmt, self.paths = experts.fmt, experts.paths

    @property
    def nbytes(self) -> int:
        return self.local.nbytes

    def default_path(self, tokens: int) -> str:
        return self.local.default_path(tokens)

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 path: str | None = None) -> torch.Tensor:
        mine = (topk_ids >= self.first) & (topk_ids < self.stop)  # [T, k]
        out = torch.zeros(x.shape[0], self.hidden_size, dtype=torch.float32, device=x.device)  # [T, H]
        slots = mine.nonzero()  # [n, 2]: (token, choice) of this rank's slots
        if slots.shape[0] == 0:
            return out
        tokens = slots[:, 0]
        ids = (topk_ids[mine] - self.first).unsqueeze(1)  # [n, 1] local expert ids
        y = self.local(x[tokens], ids, topk_weights[mine].unsqueeze(1), path)  # [n, H] weighted
        return out.index_add_(0, tokens, y)


def _on(sw: StoredWeight, device: torch.device | str) -> StoredWeight:
    return StoredWeight({k: t.to(device) for k, t in sw.tensors.items()}, sw.shape)


def load_moe(loader: WeightLoader, prefix: str) -> dict[str, MoEBlock]:
    """One MoEBlock per target format for the MoE layer at `<prefix>mlp.`."""
    cfg = loader.cfg
    p = f"{prefix}mlp."
    dev = loader.device
    gate_weight = loader.tensor(f"{p}gate.weight").float().to(dev)  # [E, H], replicated
    bias_name = f"{p}gate.e_score_correction_bias"
    bias = loader.tensor(bias_name).float().to(dev) if bias_name in loader else None  # [E]
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
        h = cfg.hidden_size
        i_s = loader.plan.shared_expert_size() if loader.plan is not None else \
            cfg.moe_intermediate_size * cfg.n_shared_experts
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
    blocks = {}
    for key in targets:
        experts: RoutedExperts | ExpertShard = RoutedExperts(fmts[key], gate_ups[key], downs[key], loader.dtype)
        if loader.plan is not None and loader.plan.expert_parallel:
            experts = ExpertShard(experts, loader.plan.experts.start, cfg.num_experts)
        blocks[key] = MoEBlock(mcfg, gate_weight, bias, experts, *shared[key])  # type: ignore[arg-type]
    return blocks
