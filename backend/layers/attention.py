"""GQA attention over the paged KV cache: fused qkv GEMM, optional per-head q/k RMSNorm,
full or partial RoPE, K/V stored into pages, paged attention, o_proj.

    x [T, hidden] -> qkv [T, (H + 2 H_kv) * head_dim]  (+ q/k/v biases when the model has them)
      -> q/k [T, H + H_kv, head_dim] -> RMSNorm per head (use_qk_norm) -> RoPE -> store k, v
      -> attention [T, H, head_dim] (scale head_dim^-0.5) -> o_proj (no bias) -> [T, hidden]

q/k rows (and their biases and q/k norm weights) are reordered at load for the
complex-multiply RoPE (`backend/rope.py`); v rows keep their order.
"""

from __future__ import annotations

import torch

from backend.attention import StepMetadata, paged_attention
from backend.config import ModelConfig
from backend.kv_cache import PagedKVCache
from backend.layers.loader import WeightLoader
from backend.layers.norm import rms_norm
from backend.linear import LinearOp
from backend.rope import RotaryEmbedding, interleave_rope_rows

__all__ = ["AttentionWeights", "load_attention", "attention", "run_linear"]


def run_linear(op: LinearOp, decode_op: LinearOp, x: torch.Tensor, split: int) -> torch.Tensor:
    """op(x) [T, out_features]; with split > 0 the first `split` rows (a mixed step's decode
    rows) run decode_op instead, as a GEMM of their own. Any callable x [T, in] -> [T, out]
    (a linear, a MoE block) runs per phase this way."""
    if not split:
        return op(x)
    return torch.cat([decode_op(x[:split]), op(x[split:])])


class AttentionWeights:
    """The attention weights of one layer: per target format its qkv and o_proj linears, and the
    per-head q/k norm weight [H + H_kv, head_dim] (None without use_qk_norm), shared."""

    def __init__(self, qkv: dict[str, LinearOp], o_proj: dict[str, LinearOp], qk_norm: torch.Tensor | None) -> None:
        self.qkv = qkv
        self.o_proj = o_proj
        self.qk_norm = qk_norm


def load_attention(loader: WeightLoader, prefix: str) -> AttentionWeights:
    """`<prefix>self_attn.{q,k,v,o}_proj` (+ q/k/v biases when config.attention_bias and the
    checkpoint has them, + `{q,k}_norm` when config.use_qk_norm)."""
    cfg = loader.cfg
    hidden, hd, rot = cfg.hidden_size, cfg.head_dim, cfg.rotary_dim
    q_rows, kv_rows = cfg.num_heads * hd, cfg.num_kv_heads * hd
    names = [f"{prefix}self_attn.{n}_proj" for n in ("q", "k", "v")]
    heads = (cfg.num_heads, cfg.num_kv_heads, 0)  # q and k rows go to interleaved pairs, v rows stay
    bias = None
    if cfg.attention_bias and f"{names[0]}.bias" in loader:
        bias = torch.cat([interleave_rope_rows(loader.get(f"{n}.bias"), h, hd, rot) if h else loader.get(f"{n}.bias")
                          for n, h in zip(names, heads)])
    qkv = loader.linears([(n, (rows, hidden), h) for n, rows, h in zip(names, (q_rows, kv_rows, kv_rows), heads)],
                         bias)
    o_proj = loader.linears([(f"{prefix}self_attn.o_proj", (hidden, q_rows), 0)])
    qk_norm = None
    if cfg.use_qk_norm:
        q_norm, k_norm = (interleave_rope_rows(loader.get(f"{prefix}self_attn.{n}_norm.weight"), 1, hd, rot)
                          for n in ("q", "k"))
        qk_norm = torch.cat([q_norm.expand(cfg.num_heads, hd), k_norm.expand(cfg.num_kv_heads, hd)])
    return AttentionWeights(qkv, o_proj, qk_norm)  # qk_norm: [H + H_kv, head_dim]


def attention(cfg: ModelConfig, qkv: LinearOp, decode_qkv: LinearOp, o_proj: LinearOp, decode_o_proj: LinearOp,
              qk_norm: torch.Tensor | None, x: torch.Tensor, split: int, freqs: torch.Tensor,
              cache: PagedKVCache, layer: int, meta: StepMetadata) -> torch.Tensor:
    """Attention output [T, hidden] of x [T, hidden] (normed), storing this step's K/V into `cache`.
    `split`: a mixed step's decode rows run the decode_* linears (see `run_linear`). Rows of x after the
    step's tokens (zeros that round its GEMMs' row count, `backend/gemm_rows.py`) get zeros."""
    t, hd = meta.slots.shape[0], cfg.head_dim
    num_qk_heads = cfg.num_heads + cfg.num_kv_heads
    qkv_out = run_linear(qkv, decode_qkv, x, split)[:t]  # [T, (H + 2 H_kv) * head_dim]
    qk, v = qkv_out.split([num_qk_heads * hd, cfg.num_kv_heads * hd], dim=-1)
    qk = qk.view(t, num_qk_heads, hd)
    if qk_norm is not None:
        qk = rms_norm(qk, qk_norm, cfg.rms_norm_eps)
    qk = RotaryEmbedding.apply(qk, freqs)
    q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads:]
    cache.store(layer, meta.slots, k, v.view(t, cfg.num_kv_heads, hd))
    out = paged_attention(q, cache, layer, meta, hd ** -0.5).reshape(t, -1)  # [T, H * head_dim]
    if x.shape[0] > t:
        out = torch.cat([out, out.new_zeros(x.shape[0] - t, out.shape[1])])
    return run_linear(o_proj, decode_o_proj, out, split)
