"""Layer-by-layer GPTQ calibration of a GQA decoder (Llama, Qwen2, Glm4Moe), bounded in memory.

What GPTQ needs of a linear is its inputs on representative text (`ops/gptq.py`). A whole
model's activations would not fit for the large MoE checkpoints, so the model is walked
one decoder layer at a time, as the GPTQ reference does, holding only the hidden states
of the calibration tokens ([S, L, hidden] float32) and one layer's dense weights:

    h = embed[ids]                                        # [S, L, hidden]
    for each layer i:
        x = rms_norm(h)                     -> GPTQ q/k/v (one Hessian: they read the same x)
        a = attention with the QUANTISED q/k/v (causal, each sequence from position 0)
                                            -> GPTQ o_proj on a
        h = h + o_proj_q(a)
        x = rms_norm(h)                     -> dense MLP: GPTQ gate/up, then down on silu(g) * u
                                               of the quantised gate/up
                                               MoE: route x (router dense, float32), then per
                                               routed expert GPTQ on the tokens routed to it,
                                               the shared experts on every token
        h = h + mlp_q(x)                    # the quantised layer's output: the next layer's input

so every linear is calibrated on the inputs the *quantised* model will give it
("true sequential"), and the layer's weights are dropped before the next layer is read.
Weights are read through a callable (the quantiser's streamed reader: dense, FP8
dequantised block by block, or a fused experts tensor's slice), one layer at a time.

The forward is a float32 re-implementation of our runtime's layer (`backend/layers/`) on
the checkpoint's own row order (no RoPE row interleaving): NeoX rotation of the first
`rotary_dim` dims of each head with `rope_inv_freq`'s frequencies and attention factor,
per-head q/k RMSNorm before RoPE (`use_qk_norm`), q/k/v biases when the checkpoint has
them, scale head_dim^-0.5, `backend.moe_router.route` for the experts (weights
multiplied in, shared experts added unscaled). A routed expert that receives fewer than
`min_expert_tokens` calibration tokens (default: the INT4 group size) has too few rows for
a Hessian worth trusting and is rounded to nearest instead; such experts are counted.
MLA decoders (DeepSeek-V3, Kimi K2.x, GLM-5) are not covered: `--method rtn` converts them.

Linears an ignore list keeps dense are not quantised; the forward runs the dense weight the
output holds for them. A compressed-tensors (`PackQuantizedWriter`) target is quantised on
its symmetric grid and packed. `DenseWeights` reads a linear's float weight from the input
as the quantiser streams it, and `in_layer_order` orders the written tensors layer by layer.

Calibration text (`calibration_ids`): Brown corpus genres A-H (press, religion, skills and
hobbies, popular lore, belles-lettres, government documents) by default; `edgeserve bench
weights` evaluates on genres J-R (learned writing, fiction, humour), so the two never share
a document. Or any
UTF-8 text file. The first N tokens are cut into sequences of L = min(2048, N, the model's
context) tokens each (the last partial sequence is dropped).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from backend.compressed_tensors import PackQuantizedWriter
from backend.config import ModelConfig
from backend.errors import UnsupportedArchitecture, WeightsError
from backend.layers.norm import rms_norm
from backend.moe_router import MoEConfig, route
from backend.rope import rope_inv_freq
from backend.weight_formats import Int4Format, StoredWeight
from backend.weights import CheckpointReader
from ops.gptq import DEFAULT_DAMP, HessianAccumulator, gptq_quantize, prepare_hessian

if TYPE_CHECKING:
    from ops.quantize import QuantizePlan

__all__ = ["CALIB_GENRES", "EVAL_GENRES", "DEFAULT_CALIB_TOKENS", "CalibrationStats", "LayerCalibrator",
           "DenseWeights", "calibration_ids", "in_layer_order"]

CALIB_GENRES = "abcdefgh"  # Brown genres for calibration
EVAL_GENRES = "jklmnpr"  # Brown genres for evaluation (bench weights); disjoint from CALIB_GENRES
DEFAULT_CALIB_TOKENS = 8192
DEFAULT_SEQ_LEN = 2048
_Step = tuple[str, Any]  # (input tensor or linear module, its output specs): a quantize plan step


@dataclass
class CalibrationStats:
    """What calibration did, for the size report."""

    tokens: int = 0  # calibration tokens run through the model
    sequences: int = 0
    seq_len: int = 0
    gptq_linears: int = 0  # linear modules quantised by GPTQ
    rtn_experts: list[str] = field(default_factory=list)  # routed experts rounded to nearest (too few tokens)
    seconds: float = 0.0  # spent in calibration and GPTQ


def calibration_ids(model_dir: Path, cfg: ModelConfig, num_tokens: int, text_file: Path | None = None,
                    seq_len: int = DEFAULT_SEQ_LEN) -> torch.Tensor:
    """Calibration token ids [S, L] (int64) from `text_file` or Brown genres A-H, with the model's
    tokenizer. Raises `WeightsError` when the text is too short or the model has no tokenizer."""
    from backend.tokenizer import Tokenizer

    if num_tokens < 1:
        raise WeightsError(f"--calib-tokens must be positive, got {num_tokens}")
    if not (Path(model_dir) / "tokenizer.json").is_file():
        raise WeightsError(f"GPTQ calibrates on text, but {model_dir} has no tokenizer.json; use --method rtn",
                           file=str(model_dir))
    tok = Tokenizer.from_model_dir(model_dir)
    if text_file is not None:
        try:
            text = Path(text_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise WeightsError(f"cannot read calibration file {text_file}: {exc}", file=str(text_file)) from exc
        ids, source = tok.encode(text), str(text_file)
    else:
        from ops.brown_corpus import corpus_tokens, fetch_brown

        ids, _ = corpus_tokens(tok.encode, num_tokens, fetch_brown(), CALIB_GENRES)
        source = f"Brown genres {CALIB_GENRES.upper()}"
    if len(ids) < num_tokens:
        raise WeightsError(f"the calibration text ({source}) gives {len(ids)} tokens, fewer than the "
                           f"--calib-tokens {num_tokens} asked for", file=str(text_file or ""))
    if max(ids[:num_tokens]) >= cfg.vocab_size:
        raise WeightsError(f"the tokenizer in {model_dir} gives id {max(ids)}, beyond the model's vocab_size "
                           f"{cfg.vocab_size}")
    length = min(seq_len, num_tokens, cfg.max_position_embeddings)
    count = num_tokens // length
    return torch.tensor(ids[:count * length], dtype=torch.int64).view(count, length)  # [S, L]


class DenseWeights:
    """A linear module's float weight [N, K] as the input stores it: dense, FP8 dequantised with its
    block scales, or a slice of a fused experts tensor (read once for the run of its experts)."""

    def __init__(self, reader: CheckpointReader, plan: QuantizePlan) -> None:
        """`plan` is `ops.quantize.plan_quantize`'s: where fused experts live, the input format."""
        self.reader, self.plan = reader, plan
        self._fused_name, self._fused = "", torch.empty(0)

    def __call__(self, module: str) -> torch.Tensor:
        plan = self.plan
        if module in plan.slices:
            piece = plan.slices[module]
            if piece.tensor != self._fused_name:
                self._fused_name, self._fused = piece.tensor, self.reader.get(piece.tensor)  # [E, rows, K]
            return self._fused[piece.expert, piece.start:piece.stop].contiguous()  # [rows, K]
        if plan.source is None:
            return self.reader.get(f"{module}.weight")
        return plan.source.dequantize(plan.source.read(self.reader.get, module))


def _layer_of(name: str) -> int:
    """The decoder layer a tensor or module belongs to (-1: none)."""
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() else -1


def in_layer_order(steps: list[_Step], num_layers: int) -> list[_Step]:
    """`steps` regrouped layer by layer (a stable sort): tensors of no layer first, then layer 0, 1, ...,
    then the multi-token-prediction layers. Checkpoint order sorts `layers.10` before `layers.2`;
    calibration walks the layers in order, so the writer does too."""
    def key(step: _Step) -> int:
        layer = _layer_of(step[0])
        return layer if layer < num_layers else num_layers + layer
    return sorted(steps, key=key)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotation of x [S, L, heads, head_dim]'s first 2 * cos.shape[-1] dims (cos, sin [L, rot/2])."""
    half = cos.shape[-1]
    cos, sin = cos[:, None], sin[:, None]  # [L, 1, rot/2]
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


class LayerCalibrator:
    """Walks the decoder layers in order; `next_layer()` quantises one layer's linears with GPTQ
    and advances the hidden states through the quantised layer (see the module docstring).

    `get(name)` reads a dense checkpoint tensor (norms, embedding, router); `weight(module)`
    a linear's float weight [N, K]; `has(name)` says whether the checkpoint has a tensor.
    Linears `kept(module)` (an ignore list) are not quantised: the forward runs `served(module)`,
    the dense weight the output checkpoint holds for them. A `PackQuantizedWriter` target gets
    the symmetric grid and its packed tensors."""

    def __init__(self, cfg: ModelConfig, ids: torch.Tensor, fmt: Int4Format, get: Callable[[str], torch.Tensor],
                 weight: Callable[[str], torch.Tensor], has: Callable[[str], bool], act_order: bool = True,
                 min_expert_tokens: int | None = None, kept: Callable[[str], bool] = lambda module: False,
                 served: Callable[[str], torch.Tensor] | None = None, damp: float = DEFAULT_DAMP,
                 static_groups: bool = False, clip: bool = True) -> None:
        if cfg.is_mla:
            raise UnsupportedArchitecture(f"GPTQ calibration covers GQA decoders (Llama, Qwen2, Glm4Moe); "
                                          f"{cfg.architecture} uses latent attention: use --method rtn")
        self.cfg, self.fmt, self.act_order, self.damp = cfg, fmt, act_order, damp
        self.static_groups, self.clip = static_groups, clip
        self.get, self.weight, self.has = get, weight, has
        self.kept, self.served = kept, served or weight
        self.symmetric = isinstance(fmt, PackQuantizedWriter)  # compressed-tensors' grid (ops/gptq.py)
        self.min_expert_tokens = fmt.group_size if min_expert_tokens is None else min_expert_tokens
        self.layer = 0
        self.stats = CalibrationStats(tokens=ids.numel(), sequences=ids.shape[0], seq_len=ids.shape[1])
        started = time.perf_counter()
        self.h = F.embedding(ids, get("model.embed_tokens.weight").float())  # [S, L, hidden]
        inv_freq, factor = rope_inv_freq(cfg)
        angles = torch.outer(torch.arange(ids.shape[1], dtype=torch.float32), inv_freq)  # [L, rot/2]
        self.cos, self.sin = factor * angles.cos(), factor * angles.sin()
        self.stats.seconds += time.perf_counter() - started

    # ---------------------------------------------------------------- quantising

    def _quantise(self, x: torch.Tensor, modules: Iterable[str], out: dict[str, StoredWeight],
                  gptq: bool = True) -> list[torch.Tensor]:
        """Quantise `modules` (which all read x [..., K]), GPTQ against x's Hessian (one for all: rows
        are independent) or RTN; their stored weights go into `out`. Returns the weights [N, K] the
        quantised model computes with, in order (a kept linear's dense weight)."""
        modules = list(modules)
        todo = [m for m in modules if not self.kept(m)]
        deq = {m: self.served(m).float() for m in modules if self.kept(m)}
        if todo and gptq:
            acc = HessianAccumulator(x.shape[-1])
            acc.add(x)
            prepared = prepare_hessian(acc.value(), self.act_order, self.damp)
            weights = [self.weight(m) for m in todo]
            result = gptq_quantize(torch.cat(weights), prepared, self.fmt, symmetric=self.symmetric,
                                   static_groups=self.static_groups, clip=self.clip)
            rows = [w.shape[0] for w in weights]
            for m, part, d in zip(todo, _split_rows(result.stored, rows), result.dequantized.split(rows)):
                out[m] = self.fmt.pack(part, m) if self.symmetric else part
                deq[m] = d
            self.stats.gptq_linears += len(todo)
        else:
            for m in todo:
                out[m] = self.fmt.quantize(self.weight(m))
                deq[m] = self.fmt.dequantize(out[m])
        return [deq[m] for m in modules]

    # ---------------------------------------------------------------- the layer

    def next_layer(self) -> dict[str, StoredWeight]:
        """Quantise layer `self.layer`'s linears (module name -> INT4 weight), run the quantised
        layer on the hidden states, and move on to the next layer."""
        started = time.perf_counter()
        cfg, i = self.cfg, self.layer
        if i >= cfg.num_layers:
            raise IndexError(f"the model has {cfg.num_layers} layers")
        p = f"model.layers.{i}."
        out: dict[str, StoredWeight] = {}
        x = rms_norm(self.h, self.get(f"{p}input_layernorm.weight").float(), cfg.rms_norm_eps)
        self.h = self.h + self._attention(p, x, out)
        x = rms_norm(self.h, self.get(f"{p}post_attention_layernorm.weight").float(), cfg.rms_norm_eps)
        flat = x.reshape(-1, x.shape[-1])  # [T, hidden]
        y = self._moe(p, flat, out) if cfg.is_moe_layer(i) else self._mlp(f"{p}mlp.", flat, out)
        self.h = self.h + y.view_as(self.h)
        self.layer += 1
        self.stats.seconds += time.perf_counter() - started
        return out

    def _attention(self, p: str, x: torch.Tensor, out: dict[str, StoredWeight]) -> torch.Tensor:
        cfg = self.cfg
        s, length, _ = x.shape
        hd, nh, nkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        a = f"{p}self_attn."
        wq, wk, wv = self._quantise(x, [f"{a}{n}_proj" for n in "qkv"], out)
        q, k, v = (x @ w.t() for w in (wq, wk, wv))
        if cfg.attention_bias and self.has(f"{a}q_proj.bias"):
            q, k, v = (t + self.get(f"{a}{n}_proj.bias").float() for t, n in zip((q, k, v), "qkv"))
        q, k, v = q.view(s, length, nh, hd), k.view(s, length, nkv, hd), v.view(s, length, nkv, hd)
        if cfg.use_qk_norm:
            q = rms_norm(q, self.get(f"{a}q_norm.weight").float(), cfg.rms_norm_eps)
            k = rms_norm(k, self.get(f"{a}k_norm.weight").float(), cfg.rms_norm_eps)
        q, k = _rope(q, self.cos, self.sin), _rope(k, self.cos, self.sin)
        heads = []
        for j in range(s):  # one sequence at a time: bounded attention memory
            o = F.scaled_dot_product_attention(q[j].transpose(0, 1), k[j].transpose(0, 1), v[j].transpose(0, 1),
                                               is_causal=True, scale=hd ** -0.5, enable_gqa=True)  # [H, L, hd]
            heads.append(o.transpose(0, 1).reshape(length, nh * hd))
        attn = torch.stack(heads)  # [S, L, H * hd]
        (wo,) = self._quantise(attn, [f"{a}o_proj"], out)
        return attn @ wo.t()

    def _mlp(self, prefix: str, x: torch.Tensor, out: dict[str, StoredWeight], gptq: bool = True) -> torch.Tensor:
        """SwiGLU `<prefix>{gate,up,down}_proj` on x [T, hidden], quantised (GPTQ or RTN) first."""
        wg, wu = self._quantise(x, [f"{prefix}{n}_proj" for n in ("gate", "up")], out, gptq)
        inner = F.silu(x @ wg.t()) * (x @ wu.t())  # [T, intermediate]
        (wd,) = self._quantise(inner, [f"{prefix}down_proj"], out, gptq)
        return inner @ wd.t()

    def _moe(self, p: str, x: torch.Tensor, out: dict[str, StoredWeight]) -> torch.Tensor:
        cfg = self.cfg
        moe = MoEConfig(num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok, n_group=cfg.n_group,
                        topk_group=cfg.topk_group, norm_topk_prob=cfg.norm_topk_prob,
                        routed_scaling_factor=cfg.routed_scaling_factor)
        bias_name = f"{p}mlp.gate.e_score_correction_bias"
        bias = self.get(bias_name) if self.has(bias_name) else None
        ids, weights = route(x, self.get(f"{p}mlp.gate.weight"), bias, moe)  # [T, k] each
        y = torch.zeros_like(x)
        for e in range(cfg.num_experts):
            rows, slots = (ids == e).nonzero(as_tuple=True)
            name = f"{p}mlp.experts.{e}."
            gptq = rows.numel() >= max(self.min_expert_tokens, 1)
            if not gptq:
                self.stats.rtn_experts.append(name.rstrip("."))
            ye = self._mlp(name, x[rows], out, gptq)
            y.index_add_(0, rows, ye * weights[rows, slots].unsqueeze(1))
        if cfg.n_shared_experts:
            y += self._mlp(f"{p}mlp.shared_experts.", x, out)
        return y


def _split_rows(sw: StoredWeight, rows: list[int]) -> list[StoredWeight]:
    """An INT4 weight stacked along N cut back into its parts (scales and zeros are per row)."""
    parts = {s: t.split(rows) for s, t in sw.tensors.items()}
    return [StoredWeight({s: parts[s][j].contiguous() for s in parts}, (n, sw.shape[1])) for j, n in enumerate(rows)]
