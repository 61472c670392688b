"""Layer-by-layer GPTQ calibration of a decoder, bounded in memory.

Architectures: Llama, Qwen2, Glm4Moe; MLA: DeepSeek-V3, Kimi K2.x, GLM-5.

What GPTQ needs of a linear is its inputs on representative text (`ops/gptq.py`). A whole
model's activations would not fit for the large MoE checkpoints, so the model is walked
one decoder layer at a time, as the GPTQ reference does, holding only the hidden states
of the calibration tokens ([S, L, hidden] float32) and one layer's dense weights:

    h = embed[ids]                                        # [S, L, hidden]
    for each layer i:
        x = rms_norm(h)                     -> GQA: GPTQ q/k/v (one Hessian: they read the same x)
                                               MLA: GPTQ q_a (or q) with kv_a; q_b on the normed
                                               query latent, kv_b on the normed c_kv
        a = attention with the QUANTISED projections (causal, each sequence from position 0)
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
MLA (`backend/layers/mla.py`) runs non-absorbed: kv_b expands c_kv into per-head keys and
values, the roped key part is shared by every head, RoPE rotates interleaved pairs
(rope_interleave checkpoints) or NeoX halves, softmax scale `mla_softmax_scale`, biases on
q_a/kv_a/o when the config has them. GLM-5's sparse attention keeps every key of a sequence
no longer than `index_topk` (2048), so calibration sequences are cut to that length and the
dense forward is exact; the indexer's wq_b and wk, when not kept dense, are calibrated on the
query latent and x they read.

With ``awq`` (`ops/awq.py`) each group of linears reading one input first gets activation-aware
input scales, folded into the norm before it (the rewritten norm weights are left in
`tensors` for the writer) or into up_proj's rows for down_proj; GPTQ (or RTN, ``gptq=False``)
then quantises the scaled weights on the scaled inputs.

Linears an ignore list keeps dense are not quantised; the forward runs the dense weight the
output holds for them. A compressed-tensors (`PackQuantizedWriter`) target is quantised on
its symmetric grid (or compressed-tensors' integer zero points) and packed.

Calibration text, the dense weights as the quantiser reads them (`DenseWeights`), and the layer
order of the written tensors (`in_layer_order`) are in `ops/calibration_inputs.py`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from backend.compressed_tensors_write import PackQuantizedWriter
from backend.config import ModelConfig
from backend.errors import WeightsError
from backend.layers.norm import rms_norm
from backend.moe_router import MoEConfig, route
from backend.rope import rope_inv_freq
from backend.weight_formats import Int4Format, StoredWeight
from ops.awq import fake_quant, fold_into_norm, input_stats, search_scales
from ops.calibration_inputs import (CALIB_GENRES, DEFAULT_CALIB_TOKENS, EVAL_GENRES, DenseWeights,  # re-exported
                                    calibration_ids, in_layer_order, layer_of)
from ops.gptq import DEFAULT_DAMP, HessianAccumulator, gptq_quantize, prepare_hessian

if TYPE_CHECKING:
    from ops.scale_tune import TuneStats

__all__ = ["CALIB_GENRES", "EVAL_GENRES", "DEFAULT_CALIB_TOKENS", "CalibrationStats", "LayerCalibrator",
           "gqa_attention", "DenseWeights", "calibration_ids", "in_layer_order", "layer_of"]



@dataclass
class CalibrationStats:
    """What calibration did, for the size report."""

    tokens: int = 0  # calibration tokens run through the model
    sequences: int = 0
    seq_len: int = 0
    gptq_linears: int = 0  # linear modules quantised by GPTQ
    rtn_experts: list[str] = field(default_factory=list)  # routed experts rounded to nearest (too few tokens)
    awq_alphas: list[float] = field(default_factory=list)  # AWQ's exponent per scaled input, in order
    seconds: float = 0.0  # spent in calibration and GPTQ (and scale tuning)
    tune: TuneStats | None = None  # when the scales were tuned end to end afterwards (`ops/scale_tune.py`)


def gqa_attention(cfg: ModelConfig, get: Callable[[str], torch.Tensor], has: Callable[[str], bool], a: str,
                  x: torch.Tensor, w: tuple[torch.Tensor, torch.Tensor, torch.Tensor], cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    """Causal GQA attention [S, L, H * hd] (before o_proj) of x [S, L, hidden] with the projections
    w = (wq, wk, wv) of module `a` ("model.layers.{i}.self_attn."): q/k/v biases when the config has them
    and `has` says the checkpoint does, per-head q/k RMSNorm (`use_qk_norm`), NeoX RoPE with cos, sin
    [L, rot/2], scale head_dim^-0.5; float32 and differentiable (`ops/scale_tune.py` trains through it)."""
    s, length, _ = x.shape
    hd, nh, nkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    q, k, v = (x @ wi.t() for wi in w)
    if cfg.attention_bias and has(f"{a}q_proj.bias"):
        q, k, v = (t + get(f"{a}{n}_proj.bias").float() for t, n in zip((q, k, v), "qkv"))
    q, k, v = q.view(s, length, nh, hd), k.view(s, length, nkv, hd), v.view(s, length, nkv, hd)
    if cfg.use_qk_norm:
        q = rms_norm(q, get(f"{a}q_norm.weight").float(), cfg.rms_norm_eps)
        k = rms_norm(k, get(f"{a}k_norm.weight").float(), cfg.rms_norm_eps)
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    heads = []
    for j in range(s):  # one sequence at a time: bounded attention memory
        o = F.scaled_dot_product_attention(q[j].transpose(0, 1), k[j].transpose(0, 1), v[j].transpose(0, 1),
                                           is_causal=True, scale=hd ** -0.5, enable_gqa=True)  # [H, L, hd]
        heads.append(o.transpose(0, 1).reshape(length, nh * hd))
    return torch.stack(heads)  # [S, L, H * hd]


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
    its grid (symmetric, or integer zero points) and its packed tensors. `awq`: AWQ input scales
    first (`ops/awq.py`); `gptq` False rounds to nearest instead of GPTQ; `act_order`, `clip`,
    `static_groups`, `refit`, `damp`: GPTQ's options (`ops/gptq.py`)."""

    def __init__(self, cfg: ModelConfig, ids: torch.Tensor, fmt: Int4Format, get: Callable[[str], torch.Tensor],
                 weight: Callable[[str], torch.Tensor], has: Callable[[str], bool], act_order: bool = True,
                 min_expert_tokens: int | None = None, kept: Callable[[str], bool] = lambda module: False,
                 served: Callable[[str], torch.Tensor] | None = None, damp: float = DEFAULT_DAMP,
                 static_groups: bool = False, clip: bool = True, awq: bool = False, gptq: bool = True,
                 refit: bool = False) -> None:
        if cfg.index_topk and ids.shape[1] > cfg.index_topk:
            raise WeightsError(f"{cfg.architecture} attends to its indexer's top {cfg.index_topk} keys beyond "
                               f"{cfg.index_topk} tokens, which calibration does not run: calibrate on sequences "
                               f"of at most {cfg.index_topk} tokens (got {ids.shape[1]})")
        self.cfg, self.fmt, self.act_order, self.damp = cfg, fmt, act_order, damp
        self.static_groups, self.clip = static_groups, clip
        self.awq, self.gptq, self.refit = awq, gptq, refit
        self.tensors: dict[str, torch.Tensor] = {}  # dense tensors the last layer rewrote (AWQ-folded norms)
        self.get, self.weight, self.has = get, weight, has
        self.kept, self.served = kept, served or weight
        self.packed = isinstance(fmt, PackQuantizedWriter)  # compressed-tensors' grids (ops/gptq.py)
        self.symmetric = self.packed and fmt.symmetric
        self.integer_zero = self.packed and not fmt.symmetric
        self._fake_quant = fake_quant(fmt.group_size, self.symmetric, self.integer_zero)
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
                  gptq: bool = True, dense: dict[str, torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Quantise `modules` (which all read x [..., K]), GPTQ against x's Hessian (one for all: rows
        are independent) or RTN; their stored weights go into `out`. `dense` overrides a module's
        float weight (AWQ-scaled). Returns the weights [N, K] the quantised model computes with, in
        order (a kept linear's dense weight)."""
        modules = list(modules)
        dense = dense or {}
        todo = [m for m in modules if not self.kept(m)]
        deq = {m: self.served(m).float() for m in modules if self.kept(m)}
        if todo and gptq and self.gptq:
            acc = HessianAccumulator(x.shape[-1])
            acc.add(x)
            prepared = prepare_hessian(acc.value(), self.act_order, self.damp)
            weights = [dense[m] if m in dense else self.weight(m) for m in todo]
            result = gptq_quantize(torch.cat(weights), prepared, self.fmt, symmetric=self.symmetric,
                                   static_groups=self.static_groups, clip=self.clip, integer_zero=self.integer_zero,
                                   refit=self.refit)
            rows = [w.shape[0] for w in weights]
            for m, part, d in zip(todo, _split_rows(result.stored, rows), result.dequantized.split(rows)):
                out[m] = self.fmt.pack(part, m) if self.packed else part
                deq[m] = d
            self.stats.gptq_linears += len(todo)
        else:
            for m in todo:
                out[m] = self.fmt.quantize(dense[m] if m in dense else self.weight(m))
                deq[m] = self.fmt.dequantize(out[m])
        return [deq[m] for m in modules]

    # ---------------------------------------------------------------- the layer

    def next_layer(self) -> dict[str, StoredWeight]:
        """Quantise layer `self.layer`'s linears (module name -> INT4 weight), run the quantised
        layer on the hidden states, and move on to the next layer. Dense tensors the layer
        rewrites (norms with AWQ scales folded in) are left in `self.tensors`."""
        started = time.perf_counter()
        cfg, i = self.cfg, self.layer
        if i >= cfg.num_layers:
            raise IndexError(f"the model has {cfg.num_layers} layers")
        p = f"model.layers.{i}."
        out: dict[str, StoredWeight] = {}
        self.tensors = {}
        if cfg.is_mla:
            first = f"{p}self_attn.q_a_proj" if cfg.q_lora_rank else f"{p}self_attn.q_proj"
            # a DSA indexer reads the same norm's output: no AWQ fold into it there
            attn_in = [] if cfg.index_topk else [first, f"{p}self_attn.kv_a_proj_with_mqa"]
            x, dense = self._normed(f"{p}input_layernorm.weight", attn_in)
            self.h = self.h + self._mla_attention(p, x, out, dense)
        else:
            x, dense = self._normed(f"{p}input_layernorm.weight", [f"{p}self_attn.{n}_proj" for n in "qkv"])
            self.h = self.h + self._attention(p, x, out, dense)
        if cfg.is_moe_layer(i):  # the router reads this norm's output too: no AWQ fold into it
            x, dense = self._normed(f"{p}post_attention_layernorm.weight", [])
        else:
            x, dense = self._normed(f"{p}post_attention_layernorm.weight", [f"{p}mlp.{n}_proj" for n in ("gate", "up")])
        flat = x.reshape(-1, x.shape[-1])  # [T, hidden]
        y = self._moe(p, flat, out) if cfg.is_moe_layer(i) else self._mlp(f"{p}mlp.", flat, out, dense=dense)
        self.h = self.h + y.view_as(self.h)
        self.layer += 1
        self.stats.seconds += time.perf_counter() - started
        return out

    def _normed(self, norm: str, modules: list[str]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """rms_norm of the hidden states with weight `norm`, and (AWQ, every one of `modules` quantised)
        the float weights of `modules` [N, K] with the searched input scales folded in: the norm's
        weight divided by them goes to `self.tensors` and the returned input is computed with it."""
        cfg, w = self.cfg, self.get(norm)
        x = rms_norm(self.h, w.float(), cfg.rms_norm_eps)
        if not self.awq or not modules or any(self.kept(m) for m in modules):
            return x, {}
        weights = {m: self.weight(m).float() for m in modules}
        h, mean = input_stats(x)
        found = search_scales(h, mean, list(weights.values()), self._fake_quant)
        self.stats.awq_alphas.append(found.alpha)
        new, s_eff = fold_into_norm(w, found.scales)
        self.tensors[norm] = new
        return rms_norm(self.h, new.float(), cfg.rms_norm_eps), {m: t * s_eff for m, t in weights.items()}

    def _attention(self, p: str, x: torch.Tensor, out: dict[str, StoredWeight],
                   dense: dict[str, torch.Tensor]) -> torch.Tensor:
        """GQA attention on x [S, L, hidden], q/k/v then o quantised. (AWQ scales for o_proj, folded into
        v_proj's rows and tied across each kv head's query heads, measured worse on SmolLM2: not done.)"""
        a = f"{p}self_attn."
        wq, wk, wv = self._quantise(x, [f"{a}{n}_proj" for n in "qkv"], out, dense=dense)
        attn = self._gqa(a, x, wq, wk, wv)
        (wo,) = self._quantise(attn, [f"{a}o_proj"], out)
        return attn @ wo.t()

    def _gqa(self, a: str, x: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor) -> torch.Tensor:
        """The attention output [S, L, H * hd] of x [S, L, hidden] with projections wq/wk/wv (module `a`)."""
        return gqa_attention(self.cfg, self.get, self.has, a, x, (wq, wk, wv), self.cos, self.sin)

    def _bias(self, module: str) -> torch.Tensor | float:
        """`module`'s bias (float32) when the config has attention biases and the checkpoint holds it, else 0."""
        return self.get(f"{module}.bias").float() if self.cfg.attention_bias and self.has(f"{module}.bias") else 0.0

    def _mla_attention(self, p: str, x: torch.Tensor, out: dict[str, StoredWeight],
                       dense: dict[str, torch.Tensor]) -> torch.Tensor:
        """Multi-head latent attention (`backend/layers/mla.py`, non-absorbed) on x [S, L, hidden], each linear
        quantised on the inputs the quantised model gives it: q_a (or q) with kv_a, q_b, kv_b, o; a DSA
        layer's indexer wq_b and wk too (on the query latent and x) unless kept dense."""
        cfg, a = self.cfg, f"{p}self_attn."
        s, length, _ = x.shape
        h, r, dr, nope, vd = cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
        first, kv_a_proj = (f"{a}q_a_proj" if cfg.q_lora_rank else f"{a}q_proj"), f"{a}kv_a_proj_with_mqa"
        w_first, w_kv_a = self._quantise(x, [first, kv_a_proj], out, dense=dense)
        q, kv_a = x @ w_first.t() + self._bias(first), x @ w_kv_a.t() + self._bias(kv_a_proj)
        if cfg.q_lora_rank:
            qr = rms_norm(q, self.get(f"{a}q_a_layernorm.weight").float(), cfg.rms_norm_eps)  # [S, L, q_lora_rank]
            (w_qb,) = self._quantise(qr, [f"{a}q_b_proj"], out)
            q = qr @ w_qb.t()
            if cfg.index_topk and cfg.indexer_types[self.layer] == "full":
                for inputs, module in ((qr, f"{a}indexer.wq_b"), (x, f"{a}indexer.wk")):
                    if not self.kept(module):
                        self._quantise(inputs, [module], out)
        c_kv = rms_norm(kv_a[..., :r], self.get(f"{a}kv_a_layernorm.weight").float(), cfg.rms_norm_eps)
        (w_kvb,) = self._quantise(c_kv, [f"{a}kv_b_proj"], out)
        kv = (c_kv @ w_kvb.t()).view(s, length, h, nope + vd)
        q = q.view(s, length, h, nope + dr)
        rope = _rope_pairs if cfg.rope_interleave else _rope
        q = torch.cat([q[..., :nope], rope(q[..., nope:], self.cos, self.sin)], dim=-1)
        k_pe = rope(kv_a[..., r:].unsqueeze(2), self.cos, self.sin).expand(s, length, h, dr)
        k, v = torch.cat([kv[..., :nope], k_pe], dim=-1), kv[..., nope:]
        heads = []
        for j in range(s):  # one sequence at a time: bounded attention memory
            o = F.scaled_dot_product_attention(q[j].transpose(0, 1), k[j].transpose(0, 1), v[j].transpose(0, 1),
                                               is_causal=True, scale=cfg.mla_softmax_scale)  # [H, L, V]
            heads.append(o.transpose(0, 1).reshape(length, h * vd))
        attn = torch.stack(heads)  # [S, L, H * V]
        (wo,) = self._quantise(attn, [f"{a}o_proj"], out)
        return attn @ wo.t() + self._bias(f"{a}o_proj")

    def _mlp(self, prefix: str, x: torch.Tensor, out: dict[str, StoredWeight], gptq: bool = True,
             dense: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """SwiGLU `<prefix>{gate,up,down}_proj` on x [T, hidden], quantised (GPTQ or RTN) first; `dense`:
        gate/up weights with AWQ input scales in. With AWQ, down_proj's input scales are searched on
        the dense MLP's inner activations and folded into up_proj's rows."""
        gate, up, down = (f"{prefix}{n}_proj" for n in ("gate", "up", "down"))
        dense = dict(dense or {})
        if self.awq and not any(self.kept(m) for m in (gate, up, down)):
            wg, wu = (dense[m] if m in dense else self.weight(m).float() for m in (gate, up))
            wd = self.weight(down).float()
            h, mean = input_stats(F.silu(x @ wg.t()) * (x @ wu.t()))
            found = search_scales(h, mean, [wd], self._fake_quant)
            self.stats.awq_alphas.append(found.alpha)
            dense.update({gate: wg, up: wu / found.scales[:, None], down: wd * found.scales})
        wg, wu = self._quantise(x, [gate, up], out, gptq, dense)
        inner = F.silu(x @ wg.t()) * (x @ wu.t())  # [T, intermediate]
        (wd,) = self._quantise(inner, [down], out, gptq, dense)
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


def _rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotation of x [S, L, heads, 2 * cos.shape[-1]] as interleaved pairs (x0, x1), (x2, x3), .. (MLA's
    rope_interleave checkpoints; the same dot products as transformers' de-interleave-then-NeoX)."""
    cos, sin = cos[:, None], sin[:, None]  # [L, 1, rot/2]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)


def _split_rows(sw: StoredWeight, rows: list[int]) -> list[StoredWeight]:
    """An INT4 weight stacked along N cut back into its parts (scales and zeros are per row)."""
    parts = {s: t.split(rows) for s, t in sw.tensors.items()}
    return [StoredWeight({s: parts[s][j].contiguous() for s in parts}, (n, sw.shape[1])) for j, n in enumerate(rows)]
