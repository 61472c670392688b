"""The decoder model every registered architecture runs as, over a paged KV cache.

A model is embeddings, a list of decoder layers, a final RMSNorm and an LM head.
Each layer is RMSNorm -> GQA attention (`layers/attention.py`), or multi-head latent
attention over a latent KV cache (`layers/mla.py`, MLA models) -> residual ->
RMSNorm -> an MLP, dense SwiGLU (`layers/mlp.py`) or mixture of experts
(`layers/experts.py`) -> residual. Which pieces a layer has, and the checkpoint
names they come from, are the architecture's business: `backend/models/` holds one
short wiring module per architecture, chosen by config.json's `architectures[0]`
(the registry in `backend/models/__init__.py`); `load_model` is the entry point.
Compute dtype float32 or bfloat16; RMSNorm runs in float32 and casts back, as the
reference does; logits are returned in float32.

For speed at small batch the projections are fused at load time:
q/k/v into one `qkv` matrix [(H + 2 * H_kv) * head_dim, hidden] and gate/up into
one `gate_up` matrix [2 * intermediate, hidden], so a dense layer is four GEMMs
(`linear.py` dispatches small batches to MKL-packed weights). q/k rows are
reordered for the complex-multiply RoPE (see `rope.py`). Parameters are plain
tensors (no nn.Module) to keep per-step dispatch short. On a CPU whose C kernels build,
a step of a dense model whose linears all run a C GEMV runs every layer in one C call
that calls the same kernels in the same order (`layers/fused_decode.py`: bit for bit the
layers below, without ~10 Python-to-C crossings a layer); `forward_local` falls back to the
Python layers for every step that does not take it.

Weights per phase: the linear layers (and the experts) can be held in one format for
prompt rows ("prefill") and another for decode rows ("decode"), e.g. FP32 or FP8 for
compute-bound prefill and INT4 for bandwidth-bound decode (formats in
`weight_formats.py`). Every row runs on its own phase's weights, whatever shares its
step: a step that mixes decode rows and prompt chunks (a unified worker's continuous
batching) runs each GEMM (and each MoE block) as two row groups, the decode rows (the
first `meta.num_decode`) on the decode format and the prompt rows on the prefill format;
the LM head, though shared, is split the same way, so a decode row never shares a
GEMM with a prompt row (see `sampler.py` for what that makes exact). A mixed step
then reads both copies of the linear weights. When both phases ask for the same
format they share one copy and every step runs each GEMM once over all its rows;
otherwise the linear layers are held twice (`weight_memory` says what each costs).
Embeddings, norms, biases, the MoE router and the LM head are shared and stay dense.

Tensor parallelism (`backend/distributed/`): loaded with a group of N ranks, each rank
holds its shard (`distributed/sharding.py`: its heads, MLP rows or experts, vocabulary
rows) and `local_cfg` is its local view (`cfg` stays the whole model's: its heads are what
the KV transfer and everything outside the model see). The forward pass is the same code plus four points
of communication: the vocab-parallel embedding lookup is all-reduced, each layer's
attention output and MLP/MoE output (partial sums of row-parallel GEMMs) are
all-reduced before the residual add, and the LM head's vocabulary columns are gathered
to rank 0, which alone gets the logits. Rank 0's `forward` first sends the step to the
other ranks (`step_channel`), which run `forward_local` on it. At world size 1 `group`
is None and none of this runs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from backend import gemm_pack
from backend.attention import StepMetadata
from backend.config import ModelConfig, load_config
from backend.errors import WeightsError
from backend.gemm_rows import builds_per_rows, pad_rows
from backend.gemm_widen import widening_pays
from backend.kv_cache import PagedKVCache
from backend.layers.attention import attention, run_linear
from backend.layers.fused_decode import enabled_by_env, fused_layers, runs_split_step, runs_step
from backend.layers.loader import WeightLoader
from backend.layers.mla import MLAWeights, mla_attention
from backend.layers.mlp import mlp
from backend.layers.norm import add_rms_norm, rms_norm
from backend.linear import Linear, LinearOp
from backend.lm_head import Int8Head, int8_head
from backend.models import architecture_module
from backend.rope import RotaryEmbedding
from backend.weight_formats import WeightFormat
from kernels.cpu_decode_layers import Refused

if TYPE_CHECKING:
    from backend.distributed.collectives import Collectives
    from backend.distributed.step_broadcast import StepChannel

__all__ = ["DecoderModel", "LayerWeights", "LlamaModel", "PHASES", "load_model"]

PHASES = ("prefill", "decode")

_linear = run_linear  # the per-phase row split, under its historical name


@dataclass
class LayerWeights:
    """One decoder layer in one weight format. A dense layer has gate_up/down, a MoE layer `moe`;
    an MLA layer has `mla` (its qkv / o_proj are the MLA's a_proj / o_proj)."""

    input_norm: torch.Tensor  # [hidden]
    qkv: LinearOp  # [(H + 2 H_kv) * head_dim, hidden], with the q/k/v biases when the model has them
    o_proj: LinearOp  # [hidden, H * head_dim]  (MLA: [hidden, H * v_head_dim])
    post_norm: torch.Tensor  # [hidden]
    gate_up: LinearOp | None = None  # [2 * intermediate, hidden]
    down: LinearOp | None = None  # [hidden, intermediate]
    moe: Callable[[torch.Tensor], torch.Tensor] | None = None  # backend.moe.MoEBlock: x [T, hidden] -> [T, hidden]
    qk_norm: torch.Tensor | None = None  # [H + H_kv, head_dim] per-head q/k RMSNorm weights (use_qk_norm)
    mla: MLAWeights | None = None  # multi-head latent attention (DeepseekV3, Kimi K2.x, GlmMoeDsa)

    def linears(self) -> list[Any]:
        """The per-format weights of this layer (what a second phase format holds again)."""
        q_b = self.mla.q_b if self.mla is not None else None
        return [w for w in (self.qkv, q_b, self.o_proj, self.gate_up, self.down, self.moe) if w is not None]

    def shared_tensors(self) -> list[torch.Tensor]:
        """Dense tensors every format shares: norms (and an MLA layer's kv_b_proj forms)."""
        extra = self.mla.shared_tensors() if self.mla is not None else []
        return [t for t in (self.input_norm, self.post_norm, self.qk_norm, *extra) if t is not None]


def load_model(model_dir: Path, dtype: torch.dtype = torch.float32, gemm_buckets: tuple[int, ...] = (),
               device: str = "cpu", prefill_weights: str | None = None, decode_weights: str | None = None,
               group_size: int = 128, group: Collectives | None = None,
               expert_parallel: bool = False, lm_head_weights: str | None = None) -> DecoderModel:
    """Load a Hugging Face-format folder (config.json + safetensors), dense or quantised, through
    the wiring module registered for its `architectures[0]`.

    group: this rank's collectives in a tensor-parallel group of more than one rank (None: the
    whole model in this process); the rank reads only its shard (`distributed/sharding.py`),
    routed experts split by intermediate rows, or by whole experts with `expert_parallel`.

    prefill_weights / decode_weights: the format of the linear layers and experts per phase
    (fp32, bf16, fp8, int4; `group_size` for int4). None keeps the stored format: a
    dense checkpoint in the compute dtype, a quantised one as it is. A format the
    checkpoint already has is used as stored (its own group size); another is made
    from the stored weights at load, one tensor at a time (FP8 -> INT4 goes through
    the dequantised FP8 values). gemm_buckets: row counts to pre-pack float32
    weights for (see `linear.py`)."""
    cfg = load_config(Path(model_dir))
    plan = None
    if group is not None and group.world > 1:
        from backend.distributed.sharding import ShardPlan

        plan = ShardPlan(cfg, group.rank, group.world, expert_parallel)
    loader = WeightLoader(Path(model_dir), cfg, dtype, gemm_buckets, device, prefill_weights, decode_weights,
                          group_size, plan)
    layers = architecture_module(cfg.architecture).load_layers(loader)  # format key -> layers
    embed = loader.get("model.embed_tokens.weight")  # [vocab (this rank's rows), hidden]
    tied = cfg.tie_word_embeddings or "lm_head.weight" not in loader
    lm_head: LinearOp = Linear(embed if tied else loader.get("lm_head.weight"), None, gemm_buckets)
    if lm_head_weights == "int8":
        lm_head = int8_head(lm_head, device)
    elif lm_head_weights is not None:
        raise WeightsError(f"unknown LM head format {lm_head_weights!r}; known: int8 (or none: as loaded)",
                           format=lm_head_weights)
    by_phase = {phase: layers[repr(fmt)] for phase, fmt in loader.formats.items()}
    model = DecoderModel(cfg, embed, by_phase, loader.get("model.norm.weight"), lm_head, dtype, loader.formats)
    model.bytes_read = loader.ckpt.bytes_read
    if plan is not None:
        model.local_cfg = loader.cfg
        model.group, model.vocab_start, model.vocab_shard = group, plan.vocab.start, plan.vocab_shard_size
        model.kv_heads = [ShardPlan(cfg, r, group.world, expert_parallel).kv_heads for r in range(group.world)]
    return model


class DecoderModel:
    """Weights plus the forward pass of one mixed prefill/decode step."""

    def __init__(self, cfg: ModelConfig, embed: torch.Tensor, layers: dict[str, list[LayerWeights]],
                 norm: torch.Tensor, lm_head: LinearOp, dtype: torch.dtype,
                 formats: dict[str, WeightFormat] | None = None) -> None:
        self.cfg = cfg  # the whole model's config
        self.local_cfg = cfg  # what this rank's layers hold (its heads, MLP rows) under tensor parallelism
        self.dtype = dtype
        self.embed = embed  # [vocab, hidden]
        self.phase_layers = layers  # phase -> layers; the same list when both phases share a format
        self.shares_weights = layers["prefill"] is layers["decode"]  # one copy: no row groups in mixed steps
        self.formats = formats or {}  # phase -> weight format of its linear layers
        self.norm = norm
        self.lm_head = lm_head  # [vocab, hidden], shares storage with embed when tied
        self.rope = RotaryEmbedding(cfg, embed.device)
        self.mla_absorb = True  # MLA decode rows: weight absorption (False: expand the latent per head)
        self.steps_by_phase: Counter[str] = Counter()  # steps by their rows: "prefill", "decode", "mixed"
        self.bytes_read = 0  # checkpoint tensor bytes read to build this model (a rank's shard only)
        self.group: Collectives | None = None  # tensor parallelism: this rank's collectives (None: one process)
        self.step_channel: StepChannel | None = None  # rank 0 of a group: sends each step to the others
        self.vocab_start, self.vocab_shard = 0, cfg.vocab_size  # this rank's first token id, rows per shard
        self.kv_heads: list[range] = [range(cfg.num_kv_heads)]  # per rank, the KV heads its pool holds
        self.fused_decode = enabled_by_env()  # decode steps may run every layer in one C call (fused_decode.py)
        self.fused_steps = 0  # steps that did
        self.fused_for_cache: tuple[Any, Any] | None = None  # (KV cache, its fused layers or None): fused_decode.py

    @classmethod
    def from_pretrained(cls, model_dir: Path, dtype: torch.dtype = torch.float32,
                        gemm_buckets: tuple[int, ...] = (), device: str = "cpu",
                        prefill_weights: str | None = None, decode_weights: str | None = None,
                        group_size: int = 128) -> DecoderModel:
        """`load_model` (any registered architecture)."""
        return load_model(model_dir, dtype, gemm_buckets, device, prefill_weights, decode_weights, group_size)

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights read per decode step (embedding row reads excluded, LM head included;
        every expert of a MoE layer counted, as a large enough batch reads them all)."""
        per_layer = sum(sum(t.nbytes for t in l.shared_tensors()) + sum(w.nbytes for w in l.linears())
                        for l in self.phase_layers["decode"])
        return per_layer + self.lm_head.nbytes

    def decode_bytes(self, rows: int) -> int:
        """`weight_bytes` as a step of `rows` logits rows reads them: the LM head's 8-bit copy where it runs them
        (`backend/lm_head.py`)."""
        head = self.lm_head
        return self.weight_bytes - head.nbytes + (head.read_bytes(rows) if isinstance(head, Int8Head) else head.nbytes)

    def pack_prompt_weights(self) -> int:
        """Pack the prompt layers' bfloat16 weights for oneDNN now (`backend/gemm_pack.py`; else each is packed at
        its first call that takes the pack, the first long prompt paying for all: ~0.27 s for SmolLM2 on a 2-core
        Xeon), on the thread and at the thread count the steps run. Not where prompt GEMMs run widened to float32
        (`backend/gemm_widen.py`): the packs then serve only calls below its rows, and are made at their first.
        Returns the bytes packed in this process."""
        todo = [op for layer in self.phase_layers["prefill"] for op in layer.linears()
                if isinstance(op, Linear) and not op.pack_tried]
        if todo and gemm_pack.available() and not widening_pays():
            for op in todo:
                op.pack_now()
        return gemm_pack.packed_bytes()

    def weight_memory(self) -> dict[str, int]:
        """Bytes held: `shared` (embedding, LM head unless tied, norms), per phase its linear
        layers and experts (`prefill`, `decode`: equal formats share one copy, counted in both and once in
        `total`), `packs` (copies held for speed: MKL's packs of float32 weights, oneDNN's of bfloat16 ones, the LM
        head's 8-bit copy) and `total`."""
        shared = {id(self.embed): self.embed.nbytes, id(self.norm): self.norm.nbytes}
        if self.lm_head.weight.data_ptr() != self.embed.data_ptr():
            shared[id(self.lm_head.weight)] = self.lm_head.nbytes
        per_phase: dict[str, int] = {}
        linears: dict[int, LinearOp] = {}
        for phase, layers in self.phase_layers.items():
            per_phase[phase] = 0
            for layer in layers:
                shared.update((id(t), t.nbytes) for t in layer.shared_tensors())
                for lin in layer.linears():
                    per_phase[phase] += lin.nbytes
                    linears[id(lin)] = lin
        packs = sum(getattr(lin, "pack_bytes", 0) for lin in [*linears.values(), self.lm_head])
        total = sum(shared.values()) + sum(lin.nbytes for lin in linears.values()) + packs
        return {"shared": sum(shared.values()), **per_phase, "packs": packs, "total": total}

    def forward(self, input_ids: torch.Tensor, meta: StepMetadata, cache: PagedKVCache,
                phase: str | None = None, *, float_logits: bool = True) -> torch.Tensor:
        """Logits [R, vocab] (float32; in the LM head's dtype with `float_logits=False`, for a caller that
        widens only what it needs) for rows `meta.logits_rows` of the flat batch input_ids [T].

        The first `meta.num_decode` rows (and logits rows) are decode rows and run on the decode
        weights, the prompt rows after them on the prefill weights (two row groups per GEMM when
        the formats differ). `phase` puts every row on that phase's weights instead. Rank 0 of a
        tensor-parallel group sends the step to the other ranks first."""
        if self.step_channel is None:
            return self.forward_local(input_ids, meta, cache, phase, float_logits=float_logits)
        with self.step_channel.lock:  # the step message and every collective of the pass, in one piece
            self.step_channel.send(input_ids, meta, phase)
            return self.forward_local(input_ids, meta, cache, phase, float_logits=float_logits)

    @torch.inference_mode()
    def forward_local(self, input_ids: torch.Tensor, meta: StepMetadata, cache: PagedKVCache,
                      phase: str | None = None, *, float_logits: bool = True) -> torch.Tensor:
        """`forward` on this rank's shard (what every rank runs): logits [R, vocab] on rank 0, and on
        the other ranks of a group their own vocabulary columns (unused). A group gathers the columns
        in the LM head's dtype; `float_logits` widens rank 0's result after the gather."""
        cfg = self.local_cfg
        group = self.group
        d = meta.num_decode
        rows = "mixed" if d and meta.prefills else "prefill" if meta.prefills else "decode"
        self.steps_by_phase[rows] += 1
        split = d if phase is None and rows == "mixed" and not self.shares_weights else 0
        layers = self.phase_layers[phase or ("decode" if rows == "decode" else "prefill")]
        h = F.embedding(input_ids, self.embed) if group is None else self._embed_shard(input_ids)  # [T, hidden]
        freqs = self.rope.tables(meta.positions)  # [T, 1, rotary_dim / 2]
        x = rms_norm(h, layers[0].input_norm, cfg.rms_norm_eps)
        if not self._run_fused(h, x, layers, split, freqs, cache, meta):
            pad = self._gemm_pad(layers, h.shape[0] - split)
            if pad:  # zero rows after the step's T up to a multiple of the granule (backend/gemm_rows.py)
                h, x = (torch.cat([t, t.new_zeros(pad, t.shape[1])]) for t in (h, x))
            self._run_layers(h, x, layers, split, freqs, cache, meta)
        h = rms_norm(h[meta.logits_rows], self.norm, cfg.rms_norm_eps)
        if split and h.shape[0] > split:  # decode rows and completed prompts: the LM head per group too
            logits = _linear(self.lm_head, self.lm_head, h, split)
        else:
            logits = self.lm_head(h)
        if group is not None:
            full = group.gather_columns(logits, self.cfg.vocab_size, self.vocab_shard)  # [R, vocab] on rank 0
            logits = logits if full is None else full
        return logits.float() if float_logits else logits

    def _run_fused(self, h: torch.Tensor, x: torch.Tensor, layers: list[LayerWeights], split: int,
                   freqs: torch.Tensor, cache: PagedKVCache, meta: StepMetadata) -> bool:
        """Every layer in one C call per weight format (backend/layers/fused_decode.py) where the step takes
        it: rows all on one phase's weights (a decode or prompt step, or any step when both phases share
        them), or a step over two formats (`split` decode rows first) as two calls, the prompt rows' and
        then the decode rows'; and few enough rows for the C GEMVs. False, nothing touched, where it does
        not."""
        cfg = self.local_cfg
        scale = cfg.head_dim ** -0.5
        if not split:
            phase = "decode" if layers is self.phase_layers["decode"] else "prefill"
            fused = fused_layers(self, cache, phase)
            if fused is None or not runs_step(self, h.shape[0], phase):
                return False
            table, lens, tiles = meta.kernel_rows(cfg.num_heads // cfg.num_kv_heads)
            try:
                h.add_(fused.run(h, x, freqs, meta.slots, table, lens, scale, tiles))
            except Refused:
                return False
            self.fused_steps += 1
            return True
        prompt, decode = fused_layers(self, cache, "prefill"), fused_layers(self, cache, "decode")
        if prompt is None or decode is None or not runs_split_step(self, h.shape[0], split):
            return False
        table, lens, tiles = meta.kernel_rows(cfg.num_heads // cfg.num_kv_heads)
        hp = h[split:]
        try:  # the only call with tiles, so the only one the attention kernel may refuse: first, h untouched
            hp.add_(prompt.run(hp, x[split:], freqs[split:], meta.slots[split:], table[split:], lens[split:], scale,
                               tiles[split:] - split))
        except Refused:
            return False
        hd = h[:split]  # decode rows alone, no tiles: nothing the kernel refuses (shapes checked at build)
        hd.add_(decode.run(hd, x[:split], freqs[:split], meta.slots[:split], meta.decode_page_table,
                           meta.decode_context_lens, scale))
        self.fused_steps += 1
        return True

    def _gemm_pad(self, layers: list[LayerWeights], prompt_rows: int) -> int:
        """Zero rows to append to a step whose `prompt_rows` rows (after a mixed step's decode rows) run
        oneDNN GEMMs, which build kernels per row count (`backend/gemm_rows.py`); 0 where they do not, and
        for MLA or MoE layers."""
        if any(l.mla is not None or l.moe is not None for l in layers):
            return 0
        return pad_rows(prompt_rows) if builds_per_rows(layers[0].qkv, prompt_rows) else 0

    def _run_layers(self, h: torch.Tensor, x: torch.Tensor, layers: list[LayerWeights], split: int,
                    freqs: torch.Tensor, cache: PagedKVCache, meta: StepMetadata) -> None:
        """The decoder layers over h [T, hidden] (the residual stream, updated in place) from x, the first
        layer's input norm of h: `layers` for the rows' phase, the decode layers for a mixed step's first
        `split` rows."""
        cfg, group = self.local_cfg, self.group
        for i, (layer, dec) in enumerate(zip(layers, self.phase_layers["decode"])):
            if layer.mla is not None:
                a = self._mla(layer.mla, dec.mla, x, split, freqs, cache, i, meta)
            else:
                a = attention(cfg, layer.qkv, dec.qkv, layer.o_proj, dec.o_proj, layer.qk_norm, x, split, freqs,
                              cache, i, meta)
            # h += branch; x = the next norm of h (one pass on the CPU: backend/layers/norm.py)
            x = add_rms_norm(h, a if group is None else group.all_reduce(a), layer.post_norm, cfg.rms_norm_eps)
            if layer.moe is not None:
                m = run_linear(layer.moe, dec.moe, x, split)
            else:
                m = mlp(layer.gate_up, dec.gate_up, layer.down, dec.down, x, split)
            m = m if group is None else group.all_reduce(m)
            if i + 1 < len(layers):
                x = add_rms_norm(h, m, layers[i + 1].input_norm, cfg.rms_norm_eps)
            else:
                h.add_(m)

    def _embed_shard(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel embedding [T, hidden]: each rank looks up the ids in its rows (zeros for the
        others), then the ranks' rows are summed."""
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.embed.shape[0])
        h = F.embedding(local.masked_fill(outside, 0), self.embed)  # [T, hidden]
        return self.group.all_reduce(h.masked_fill_(outside.unsqueeze(1), 0.0))

    def _mla(self, w: MLAWeights, dec: MLAWeights, x: torch.Tensor, split: int, freqs: torch.Tensor, cache: Any,
             layer: int, meta: StepMetadata) -> torch.Tensor:
        """One MLA layer's attention, with its DSA key selection bound to this step when it has one."""
        selector = w.selector
        select = (lambda xs, qr: selector(xs, qr, cache, layer, meta, freqs)) if selector is not None else None
        return mla_attention(self.local_cfg, w, dec, x, split, freqs, cache, layer, meta, self.mla_absorb, select)


LlamaModel = DecoderModel  # the name the engine and the ops scripts have always used
