"""Checkpoint tensors -> runtime weights, in the formats each phase asks for.

The linear layers can be held in one format for prompt rows ("prefill") and another
for decode rows ("decode") (formats in `weight_formats.py`). A `WeightLoader` resolves
the two names against what the checkpoint stores (None keeps the stored format: a
dense checkpoint in the compute dtype, a quantised one as it is; a format the
checkpoint already has is used as stored), and builds **one runtime copy per
distinct format** (`targets`, keyed by the format's repr): equal formats share one
copy. A weight stored in another format is converted at load, one tensor at a time
(FP8 -> INT4 goes through the dequantised FP8 values). Everything that is not a
linear weight (embeddings, norms, biases, the MoE router) is read dense through `get`.

A quantised checkpoint may leave some linears dense (compressed-tensors' `ignore`
list: Kimi's attention and shared experts; FP8 checkpoints' unconverted modules).
Such a module stays dense, in the compute dtype, wherever the target is the
checkpoint's own format (`target_format`): keeping the stored format means keeping
every module as its quantiser left it. A fused group (q/k/v, gate/up) that mixes a
dense module with quantised ones is made dense as a whole (the quantised parts
dequantised exactly). A target the checkpoint does not have converts everything.

Names are the architecture's plain ones (`model.layers.0.self_attn.kv_b_proj`); a
checkpoint that keeps the text model under a prefix (`cfg.checkpoint_prefix`,
`language_model.` for Kimi K2.5/K2.6) is read under it (`weights.CheckpointReader`).

Tensor parallelism: a loader given a `ShardPlan` (`backend/distributed/sharding.py`)
reads only its rank's slice of each tensor (`CheckpointReader.get_slice`), and its
`cfg` is the rank's local view (its heads, its MLP rows), so the layer code computes
local shapes as it computes whole ones; `global_cfg` is the checkpoint's. A quantised
checkpoint is sliced in its format (`backend/distributed/weight_slices.py`): FP8
block-scaled weights with the scales of every block the rank's rows or columns touch,
INT4 (ours and compressed-tensors pack-quantized) with their groups, whose column splits
must fall on group boundaries. The plan decides the
slice from the module's logical [N, K] shape (read from the headers), so a rank reads
the same rows or columns of a quantised weight as of its dense original. A quantised
*target* format is made from the slice after it is read.
"""

from __future__ import annotations

from pathlib import Path

import torch

from backend.config import ModelConfig
from backend.distributed.sharding import LEADER_ONLY, ShardPlan, TensorSlice
from backend.distributed.weight_slices import read_slice, stored_shape
from backend.errors import WeightsError
from backend.linear import LinearOp
from backend.rope import interleave_rope_rows
from backend.weight_formats import DenseFormat, StoredWeight, WeightFormat, stored_format, weight_format
from backend.weights import CheckpointReader

__all__ = ["LinearSpec", "WeightLoader"]

# module name, its [out, in] shape, and how its rows are reordered for RoPE: a head count (the rotary
# rows of each head to interleaved pairs, rope.py), 0 (rows kept), or an explicit row permutation
LinearSpec = tuple[str, tuple[int, int], "int | torch.Tensor"]


class WeightLoader:
    """One model folder being read: its config, its checkpoint and the per-phase formats."""

    def __init__(self, model_dir: Path, cfg: ModelConfig, dtype: torch.dtype, gemm_buckets: tuple[int, ...] = (),
                 device: str = "cpu", prefill_weights: str | None = None, decode_weights: str | None = None,
                 group_size: int = 128, plan: ShardPlan | None = None) -> None:
        self.global_cfg = cfg
        self.plan = plan
        self.cfg = plan.local_config() if plan is not None else cfg
        self.dtype = dtype
        self.device = device
        self.gemm_buckets = gemm_buckets
        self.ckpt = CheckpointReader(Path(model_dir), cfg.checkpoint_prefix)
        self.stored = stored_format(cfg.quantization, cfg.checkpoint_prefix)

        def resolve(name: str | None) -> WeightFormat:
            if name is None:
                return self.stored or DenseFormat(dtype)
            if self.stored is not None and name == self.stored.name:
                return self.stored
            return weight_format(name, group_size)

        self.formats = {"prefill": resolve(prefill_weights), "decode": resolve(decode_weights)}
        self.targets = {repr(f): f for f in self.formats.values()}  # one copy per distinct format

    def __contains__(self, name: str) -> bool:
        return name in self.ckpt

    def get(self, name: str) -> torch.Tensor:
        """A dense tensor in the compute dtype on the device (this rank's slice of it under a plan)."""
        return self.tensor(name).to(device=self.device, dtype=self.dtype).contiguous()

    def tensor(self, name: str) -> torch.Tensor:
        """A tensor as stored: whole, or under a `ShardPlan` this rank's slice of it (zeros on ranks
        other than 0 for the bias of a row-parallel linear), reading only that slice."""
        if self.plan is None:
            return self.ckpt.get(name)
        spec = self.ckpt.spec(name)
        how = self.plan.slice_of(name, spec.shape)
        if how is None:
            return self.ckpt.get(name)
        if how == LEADER_ONLY:
            return self.ckpt.get(name) if self.plan.rank == 0 else torch.zeros(spec.shape, dtype=spec.dtype)
        return self.ckpt.get_slice(name, *how)

    def read(self, module: str, shape: tuple[int, int] | None = None) -> tuple[WeightFormat, StoredWeight]:
        """A linear weight as stored (dense: in its own dtype), checked against `shape` when given;
        under a `ShardPlan` this rank's rows or columns of it. In a quantised checkpoint, a module
        stored without its format's extra tensors (a layer the quantiser left dense) is read dense.
        The format returned is the one the weight is held in: the stored one, except for an FP8
        slice whose columns start inside a scale block (dequantised: see `weight_slices.py`)."""
        stored = self.stored
        if stored is None or stored.stores_dense(module, self.ckpt.__contains__):
            raw = self.tensor(f"{module}.weight")
            src: WeightFormat = DenseFormat(raw.dtype)
            sw = src.read(lambda _: raw, module)  # refuses non-float (e.g. FP8) tensors
        else:
            how = None
            if self.plan is not None:
                how = self.plan.slice_of(f"{module}.weight", stored_shape(stored, self.ckpt.spec, module))
            if isinstance(how, TensorSlice):
                src, sw = read_slice(stored, self.ckpt.get_region, self.ckpt.spec, module, *how)
            else:  # replicated (a whole routed expert under expert parallelism, the MLA down projections)
                src, sw = stored, stored.read(self.ckpt.get, module)
        if shape is not None and sw.shape != shape:
            raise WeightsError(f"{module} has shape {list(sw.shape)}, the config needs {list(shape)}",
                               tensor=module)
        return src, sw

    @staticmethod
    def convert(src: WeightFormat, sw: StoredWeight, dst: WeightFormat) -> StoredWeight:
        """`sw` (stored in `src`) in format `dst`: as it is when the formats agree."""
        return sw if repr(src) == repr(dst) else dst.quantize(src.dequantize(sw))

    def target_format(self, srcs: list[WeightFormat], dst: WeightFormat) -> WeightFormat:
        """The format weights read in `srcs` (the parts of one fused linear) take in target `dst`:
        `dst`, or dense in the compute dtype when `dst` is the checkpoint's own format and a part
        was stored dense (see the module docstring)."""
        if dst is self.stored and any(isinstance(src, DenseFormat) for src in srcs):
            return DenseFormat(self.dtype)
        return dst

    def linears(self, modules: list[LinearSpec], bias: torch.Tensor | None = None) -> dict[str, LinearOp]:
        """One runtime linear per target format for `modules` fused along N (rows concatenated in
        order); rows of modules with heads > 0 are reordered for RoPE (see rope.py), rows of modules
        given a permutation tensor by that permutation."""
        cfg = self.cfg
        read_parts = [self.read(m, shape) for m, shape, _ in modules]
        out = {}
        for key, dst in self.targets.items():
            fmt = self.target_format([src for src, _ in read_parts], dst)
            parts = []
            for (src, sw), (_, shape, heads) in zip(read_parts, modules):
                part = self.convert(src, sw, fmt)
                if isinstance(heads, torch.Tensor):
                    part = fmt.permute_rows(part, heads)
                elif heads:
                    perm = interleave_rope_rows(torch.arange(shape[0]), heads, cfg.head_dim, cfg.rotary_dim)
                    part = fmt.permute_rows(part, perm)
                parts.append(part)
            fused = fmt.cat_rows(parts) if len(parts) > 1 else parts[0]
            fused = StoredWeight({k: t.to(self.device) for k, t in fused.tensors.items()}, fused.shape)
            out[key] = fmt.linear(fused, bias, self.dtype, self.gemm_buckets)
        return out
