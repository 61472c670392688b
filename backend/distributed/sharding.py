"""Which slice of each checkpoint tensor a rank of a tensor-parallel group reads.

Megatron-style tensor parallelism over N ranks (rank r of N):

- column-parallel (rows of the [out, in] weight split, output features local):
  q/k/v projections by heads, gate/up projections by intermediate rows, MLA
  `q_b_proj` / `q_proj` / `kv_b_proj` by heads; their biases follow their rows;
- row-parallel (columns split, the outputs are partial sums): o_proj and down_proj;
  the model all-reduces the layer output once (a row-parallel bias is added by rank 0 only);
- vocab-parallel: the embedding and LM head rows, rank r owning token ids
  [r V / N, (r + 1) V / N) (the embedding lookup is all-reduced, the logits gathered to rank 0);
- replicated: norms, the MoE router (so every rank routes identically), the MLA
  down projections (q_a_proj, kv_a_proj_with_mqa): the latent KV is replicated per rank;
  and the DSA lightning indexer of GlmMoeDsa (`self_attn.indexer.{wq_b, wk, k_norm,
  weights_proj}`), with its key cache replicated like the latent pages. Every rank scores
  and selects the same keys from the same replicated inputs (the attention input after
  the all-reduce, the replicated q latent), so each rank's heads attend over exactly the
  keys one process would pick, and no collective is added. Splitting the indexer by its
  heads would instead need an all-reduce of the [tokens, keys] float32 scores per full
  layer before the top-k: a decode step of 32 requests over 128k keys would move 16 MiB
  per layer, against the indexer's own weights (GLM-5: wq_b 32 x 128 x 2048, wk 128 x
  6144, weights_proj 32 x 6144, ~10 M values per layer) that every rank can simply hold.

Quantised checkpoints are sliced the same way, by the module's logical [N, K] shape:
each format reads its own tensors' matching rows or columns (FP8 block scales of every
block a range touches, INT4 groups; `weight_slices.py`).

Heads: rank r holds query heads [r H / N, (r + 1) H / N) (H divisible by N) and the KV
heads those queries read. With H_kv >= N (H_kv divisible by N) the KV heads are split
the same way; with fewer KV heads than ranks (N divisible by H_kv) each KV head is
replicated on the N / H_kv ranks whose query heads use it, as the large engines do.
Either way every rank holds H / N query heads over H_kv / N (or 1) KV heads, the same
GQA group on every rank, and its KV cache holds only its own KV heads.

Mixture of experts: without expert parallelism every routed expert is split like a dense
MLP (its intermediate rows); with `expert_parallel` rank r holds whole experts
[r E / N, (r + 1) E / N) and never reads the others. Shared experts are always
tensor-parallel. Either way a rank's MoE output is a partial sum over its shard and
joins the same all-reduce as the dense layers (see `backend/layers/experts.py` for why
that is the dispatch/combine chosen).
"""

from __future__ import annotations

import dataclasses
import re
from typing import NamedTuple

from backend.config import ModelConfig
from backend.errors import ModelLoadError

__all__ = ["TensorSlice", "ShardPlan", "even_range", "REPLICATED", "LEADER_ONLY"]


class TensorSlice(NamedTuple):
    """Elements [start, stop) of dimension `dim` of a stored tensor."""

    dim: int
    start: int
    stop: int


REPLICATED = None  # every rank reads the whole tensor
LEADER_ONLY = "leader_only"  # rank 0 reads it, the others hold zeros (the bias of a row-parallel linear)


def even_range(n: int, world: int, rank: int) -> range:
    """Rank `rank`'s contiguous share of n items split over `world` ranks (sizes differ by at most one)."""
    return range(rank * n // world, (rank + 1) * n // world)


# the column-parallel projections of attention (sliced by heads) and of MLPs (sliced evenly)
_HEAD_ROWS = re.compile(r"self_attn\.(q_proj|k_proj|v_proj|q_b_proj|kv_b_proj)\.(weight|bias)$")
_MLP_ROWS = re.compile(r"mlp\.(?:shared_experts\.|experts\.(\d+)\.)?(gate_proj|up_proj)\.weight$")
_MLP_COLS = re.compile(r"mlp\.(?:shared_experts\.|experts\.(\d+)\.)?down_proj\.weight$")
_ROW_PARALLEL_BIAS = re.compile(r"(self_attn\.o_proj|down_proj)\.bias$")


class ShardPlan:
    """The shard of rank `rank` of `world` for a model of config `cfg` (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, rank: int, world: int, expert_parallel: bool = False) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in a group of {world}")
        self.cfg, self.rank, self.world, self.expert_parallel = cfg, rank, world, expert_parallel
        h, kv = cfg.num_heads, cfg.num_kv_heads
        if h % world:
            raise ModelLoadError(f"{h} attention heads do not split over {world} tensor-parallel ranks "
                                 f"(choose a divisor of {h})")
        self.heads = range(rank * h // world, (rank + 1) * h // world)
        if cfg.is_mla:  # one latent KV head, replicated; the per-head K/V come from the rank's kv_b_proj rows
            self.kv_heads = self.heads
        elif kv % world and world % kv:
            raise ModelLoadError(f"{kv} KV heads neither split over nor replicate evenly across {world} ranks")
        else:
            group = h // kv
            self.kv_heads = range(self.heads.start // group, (self.heads.stop - 1) // group + 1)
        for name, size in (("intermediate_size", cfg.intermediate_size),
                           ("moe_intermediate_size", cfg.moe_intermediate_size)):
            if size % world:
                raise ModelLoadError(f"{name} {size} does not split over {world} tensor-parallel ranks")
        if expert_parallel and cfg.num_experts % world:
            raise ModelLoadError(f"{cfg.num_experts} experts do not split over {world} expert-parallel ranks")
        self.experts = even_range(cfg.num_experts, world, rank) if expert_parallel else range(cfg.num_experts)
        self.vocab = even_range(cfg.vocab_size, world, rank)

    @property
    def vocab_shard_size(self) -> int:
        """Rows of the largest vocabulary shard (what each rank pads its logits to before the gather)."""
        return -(-self.cfg.vocab_size // self.world)

    def local_config(self) -> ModelConfig:
        """`cfg` as this rank's layers see it: its query and KV heads, its dense MLP rows, and its
        routed experts' intermediate rows (whole experts under expert parallelism)."""
        cfg = self.cfg
        moe_i = cfg.moe_intermediate_size if self.expert_parallel else cfg.moe_intermediate_size // self.world
        return dataclasses.replace(cfg, num_heads=len(self.heads), num_kv_heads=len(self.kv_heads),
                                   intermediate_size=cfg.intermediate_size // self.world,
                                   moe_intermediate_size=moe_i)

    def shared_expert_size(self) -> int:
        """Intermediate rows of this rank's shard of the shared experts (always tensor-parallel)."""
        return self.cfg.moe_intermediate_size * self.cfg.n_shared_experts // self.world

    def slice_of(self, name: str, shape: tuple[int, ...]) -> TensorSlice | str | None:
        """How this rank reads tensor `name` of stored `shape`: a `TensorSlice`, `REPLICATED` (None)
        or `LEADER_ONLY`. Per-expert tensors of experts this rank does not hold are not asked for."""
        cfg = self.cfg
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return TensorSlice(0, self.vocab.start, self.vocab.stop)
        if _ROW_PARALLEL_BIAS.search(name):
            return LEADER_ONLY
        m = _HEAD_ROWS.search(name)
        if m is not None:
            proj = m.group(1)
            if proj in ("k_proj", "v_proj"):
                return TensorSlice(0, self.kv_heads.start * cfg.head_dim, self.kv_heads.stop * cfg.head_dim)
            per_head = {"q_proj": cfg.qk_head_dim if cfg.is_mla else cfg.head_dim, "q_b_proj": cfg.qk_head_dim,
                        "kv_b_proj": cfg.qk_nope_head_dim + cfg.v_head_dim}[proj]
            return TensorSlice(0, self.heads.start * per_head, self.heads.stop * per_head)
        if name.endswith("self_attn.o_proj.weight"):
            per_head = cfg.v_head_dim if cfg.is_mla else cfg.head_dim
            return TensorSlice(1, self.heads.start * per_head, self.heads.stop * per_head)
        for pattern, dim in ((_MLP_ROWS, 0), (_MLP_COLS, 1)):
            m = pattern.search(name)
            if m is not None:
                if m.group(1) is not None and self.expert_parallel:  # a whole routed expert
                    return REPLICATED
                part = even_range(shape[dim], self.world, self.rank)
                return TensorSlice(dim, part.start, part.stop)
        return REPLICATED
