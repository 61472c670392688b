"""Llama-family decoder (Llama, Qwen2, SmolLM2) over a paged KV cache.

Dense GQA attention with RoPE, RMSNorm, SwiGLU MLP, optional tied embeddings and
(Qwen2) q/k/v biases. Compute dtype float32 or bfloat16; RMSNorm runs in float32
and casts back, as the reference does; logits are returned in float32.

For speed at small batch the projections are fused at load time:
q/k/v into one `qkv` matrix [(H + 2 * H_kv) * head_dim, hidden] and gate/up into
one `gate_up` matrix [2 * intermediate, hidden], so one layer is four GEMMs
(`linear.py` dispatches small batches to MKL-packed weights). q/k rows are
reordered for the complex-multiply RoPE (see `rope.py`). Parameters are plain
tensors (no nn.Module) to keep per-step dispatch short.

Weights per phase: the linear layers can be held in one format for prompt rows
("prefill") and another for decode rows ("decode"), e.g. FP32 or FP8 for
compute-bound prefill and INT4 for bandwidth-bound decode (formats in
`weight_formats.py`). Every row runs on its own phase's weights, whatever shares its
step: a step that mixes decode rows and prompt chunks (a unified worker's continuous
batching) runs each GEMM as two row groups, the decode rows (the first
`meta.num_decode`) on the decode format and the prompt rows on the prefill format;
the LM head, though shared, is split the same way, so a decode row never shares a
GEMM with a prompt row (see `sampler.py` for what that makes exact). A mixed step
then reads both copies of the linear weights. When both phases ask for the same
format they share one copy and every step runs each GEMM once over all its rows;
otherwise the linear layers are held twice (`weight_memory` says what each costs).
Embeddings, norms, biases and the LM head are shared and stay dense.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from backend.attention import StepMetadata, paged_attention
from backend.config import ModelConfig, load_config
from backend.errors import WeightsError
from backend.kv_cache import PagedKVCache
from backend.linear import Linear, LinearOp
from backend.rope import RotaryEmbedding, interleave_rope_rows
from backend.weight_formats import DenseFormat, StoredWeight, WeightFormat, stored_format, weight_format
from backend.weights import CheckpointReader

__all__ = ["LayerWeights", "LlamaModel", "PHASES"]

PHASES = ("prefill", "decode")


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: LinearOp  # [(H + 2 H_kv) * head_dim, hidden], with the q/k/v biases when the model has them
    o_proj: LinearOp  # [hidden, H * head_dim]
    post_norm: torch.Tensor  # [hidden]
    gate_up: LinearOp  # [2 * intermediate, hidden]
    down: LinearOp  # [hidden, intermediate]


def _linear(op: LinearOp, decode_op: LinearOp, x: torch.Tensor, split: int) -> torch.Tensor:
    """op(x) [T, out_features]; with split > 0 the first `split` rows (a mixed step's decode
    rows) run decode_op instead, as a GEMM of their own."""
    if not split:
        return op(x)
    return torch.cat([decode_op(x[:split]), op(x[split:])])


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:  # one fused op
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


class LlamaModel:
    """Weights plus the forward pass of one mixed prefill/decode step."""

    def __init__(self, cfg: ModelConfig, embed: torch.Tensor, layers: dict[str, list[LayerWeights]],
                 norm: torch.Tensor, lm_head: Linear, dtype: torch.dtype,
                 formats: dict[str, WeightFormat] | None = None) -> None:
        self.cfg = cfg
        self.dtype = dtype
        self.embed = embed  # [vocab, hidden]
        self.phase_layers = layers  # phase -> layers; the same list when both phases share a format
        self.shares_weights = layers["prefill"] is layers["decode"]  # one copy: no row groups in mixed steps
        self.formats = formats or {}  # phase -> weight format of its linear layers
        self.norm = norm
        self.lm_head = lm_head  # [vocab, hidden], shares storage with embed when tied
        self.rope = RotaryEmbedding(cfg, embed.device)
        self.scale = cfg.head_dim ** -0.5
        self._split = [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim]
        self.steps_by_phase: Counter[str] = Counter()  # steps by their rows: "prefill", "decode", "mixed"

    @classmethod
    def from_pretrained(cls, model_dir: Path, dtype: torch.dtype = torch.float32,
                        gemm_buckets: tuple[int, ...] = (), device: str = "cpu",
                        prefill_weights: str | None = None, decode_weights: str | None = None,
                        group_size: int = 128) -> LlamaModel:
        """Load a Hugging Face-format folder (config.json + safetensors), dense or quantised.

        prefill_weights / decode_weights: the format of the linear layers per phase
        (fp32, bf16, fp8, int4; `group_size` for int4). None keeps the stored format: a
        dense checkpoint in the compute dtype, a quantised one as it is. A format the
        checkpoint already has is used as stored (its own group size); another is made
        from the stored weights at load, one tensor at a time (FP8 -> INT4 goes through
        the dequantised FP8 values). gemm_buckets: row counts to pre-pack float32
        weights for (see `linear.py`)."""
        cfg = load_config(Path(model_dir))
        ckpt = CheckpointReader(Path(model_dir))
        stored = stored_format(cfg.quantization)

        def resolve(name: str | None) -> WeightFormat:
            if name is None:
                return stored or DenseFormat(dtype)
            return stored if stored is not None and name == stored.name else weight_format(name, group_size)

        formats = {"prefill": resolve(prefill_weights), "decode": resolve(decode_weights)}
        targets = {repr(f): f for f in formats.values()}  # one copy per distinct format

        def get(name: str) -> torch.Tensor:
            return ckpt.get(name).to(device=device, dtype=dtype).contiguous()

        def read(module: str, shape: tuple[int, int]) -> tuple[WeightFormat, StoredWeight]:
            """A linear weight as stored (dense: in its own dtype), checked against the config."""
            if stored is None:
                raw = ckpt.get(f"{module}.weight")
                src: WeightFormat = DenseFormat(raw.dtype)
                sw = src.read(lambda _: raw, module)  # refuses non-float (e.g. FP8) tensors
            else:
                src, sw = stored, stored.read(ckpt.get, module)
            if sw.shape != shape:
                raise WeightsError(f"{module} has shape {list(sw.shape)}, the config needs {list(shape)}",
                                   tensor=module)
            return src, sw

        def convert(src: WeightFormat, sw: StoredWeight, dst: WeightFormat) -> StoredWeight:
            return sw if repr(src) == repr(dst) else dst.quantize(src.dequantize(sw))

        def linears(modules: list[tuple[str, tuple[int, int], int]],
                    bias: torch.Tensor | None) -> dict[str, LinearOp]:
            """One runtime linear per target format for modules fused along N; rows of modules
            with heads > 0 are reordered for RoPE (see rope.py)."""
            read_parts = [read(m, shape) for m, shape, _ in modules]
            out = {}
            for key, fmt in targets.items():
                parts = []
                for (src, sw), (_, shape, heads) in zip(read_parts, modules):
                    part = convert(src, sw, fmt)
                    if heads:
                        part = fmt.permute_rows(part, interleave_rope_rows(torch.arange(shape[0]), heads,
                                                                           cfg.head_dim))
                    parts.append(part)
                fused = fmt.cat_rows(parts) if len(parts) > 1 else parts[0]
                fused = StoredWeight({k: t.to(device) for k, t in fused.tensors.items()}, fused.shape)
                out[key] = fmt.linear(fused, bias, dtype, gemm_buckets)
            return out

        hidden, inter, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        q_rows, kv_rows = cfg.num_heads * hd, cfg.num_kv_heads * hd
        layers: dict[str, list[LayerWeights]] = {key: [] for key in targets}
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            qkv_names = [f"{p}self_attn.{n}_proj" for n in ("q", "k", "v")]
            heads = (cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads)
            rope_rows = (True, True, False)  # q and k rows go to interleaved pairs (see rope.py)
            bias = None
            if cfg.attention_bias and f"{qkv_names[0]}.bias" in ckpt:
                bias = torch.cat([interleave_rope_rows(get(f"{n}.bias"), h, hd) if r else get(f"{n}.bias")
                                  for n, h, r in zip(qkv_names, heads, rope_rows)])
            qkv = linears([(n, (rows, hidden), h if r else 0) for n, rows, h, r
                           in zip(qkv_names, (q_rows, kv_rows, kv_rows), heads, rope_rows)], bias)
            o_proj = linears([(f"{p}self_attn.o_proj", (hidden, q_rows), 0)], None)
            gate_up = linears([(f"{p}mlp.gate_proj", (inter, hidden), 0), (f"{p}mlp.up_proj", (inter, hidden), 0)],
                              None)
            down = linears([(f"{p}mlp.down_proj", (hidden, inter), 0)], None)
            input_norm, post_norm = get(f"{p}input_layernorm.weight"), get(f"{p}post_attention_layernorm.weight")
            for key in targets:
                layers[key].append(LayerWeights(input_norm=input_norm, qkv=qkv[key], o_proj=o_proj[key],
                                                post_norm=post_norm, gate_up=gate_up[key], down=down[key]))
        embed = get("model.embed_tokens.weight")
        tied = cfg.tie_word_embeddings or "lm_head.weight" not in ckpt
        lm_head = Linear(embed if tied else get("lm_head.weight"), None, gemm_buckets)
        by_phase = {phase: layers[repr(fmt)] for phase, fmt in formats.items()}
        return cls(cfg, embed, by_phase, get("model.norm.weight"), lm_head, dtype, formats)

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights read per decode step (embedding row reads excluded, LM head included)."""
        per_layer = sum(l.input_norm.nbytes + l.post_norm.nbytes + l.qkv.nbytes + l.o_proj.nbytes
                        + l.gate_up.nbytes + l.down.nbytes for l in self.phase_layers["decode"])
        return per_layer + self.lm_head.nbytes

    def weight_memory(self) -> dict[str, int]:
        """Bytes held: `shared` (embedding, LM head unless tied, norms), per phase its linear
        layers (`prefill`, `decode`: equal formats share one copy, counted in both and once in
        `total`), `packs` (MKL packed copies of float32 weights) and `total`."""
        shared = {id(self.embed): self.embed.nbytes, id(self.norm): self.norm.nbytes}
        if self.lm_head.weight.data_ptr() != self.embed.data_ptr():
            shared[id(self.lm_head.weight)] = self.lm_head.nbytes
        per_phase: dict[str, int] = {}
        linears: dict[int, LinearOp] = {}
        for phase, layers in self.phase_layers.items():
            per_phase[phase] = 0
            for layer in layers:
                shared[id(layer.input_norm)] = layer.input_norm.nbytes
                shared[id(layer.post_norm)] = layer.post_norm.nbytes
                for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down):
                    per_phase[phase] += lin.nbytes
                    linears[id(lin)] = lin
        packs = sum(getattr(lin, "pack_bytes", 0) for lin in [*linears.values(), self.lm_head])
        total = sum(shared.values()) + sum(lin.nbytes for lin in linears.values()) + packs
        return {"shared": sum(shared.values()), **per_phase, "packs": packs, "total": total}

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: StepMetadata, cache: PagedKVCache,
                phase: str | None = None) -> torch.Tensor:
        """Logits [R, vocab] (float32) for rows `meta.logits_rows` of the flat batch input_ids [T].

        The first `meta.num_decode` rows (and logits rows) are decode rows and run on the decode
        weights, the prompt rows after them on the prefill weights (two row groups per GEMM when
        the formats differ). `phase` puts every row on that phase's weights instead."""
        cfg = self.cfg
        d = meta.num_decode
        rows = "mixed" if d and meta.prefills else "prefill" if meta.prefills else "decode"
        self.steps_by_phase[rows] += 1
        split = d if phase is None and rows == "mixed" and not self.shares_weights else 0
        layers = self.phase_layers[phase or ("decode" if rows == "decode" else "prefill")]
        decode_layers = self.phase_layers["decode"]
        t = input_ids.shape[0]
        h = F.embedding(input_ids, self.embed)  # [T, hidden]
        freqs = self.rope.tables(meta.positions)
        num_qk_heads = cfg.num_heads + cfg.num_kv_heads
        for i, (layer, dec) in enumerate(zip(layers, decode_layers)):
            x = _rms_norm(h, layer.input_norm, cfg.rms_norm_eps)
            qkv = _linear(layer.qkv, dec.qkv, x, split)
            qk, v = qkv.split([num_qk_heads * cfg.head_dim, self._split[1]], dim=-1)
            qk = RotaryEmbedding.apply(qk.view(t, num_qk_heads, cfg.head_dim), freqs)
            q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads:]
            cache.store(i, meta.slots, k, v.view(t, cfg.num_kv_heads, cfg.head_dim))
            attn = paged_attention(q, cache, i, meta, self.scale)
            h.add_(_linear(layer.o_proj, dec.o_proj, attn.reshape(t, -1), split))
            x = _rms_norm(h, layer.post_norm, cfg.rms_norm_eps)
            gate, up = _linear(layer.gate_up, dec.gate_up, x, split).chunk(2, dim=-1)
            h.add_(_linear(layer.down, dec.down, F.silu(gate).mul_(up), split))
        h = _rms_norm(h[meta.logits_rows], self.norm, cfg.rms_norm_eps)
        if split and h.shape[0] > split:  # decode rows and completed prompts: the LM head per group too
            return _linear(self.lm_head, self.lm_head, h, split).float()
        return self.lm_head(h).float()
