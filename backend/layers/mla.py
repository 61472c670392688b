"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi K2.x, GLM-5) over the paged latent KV cache.

Per token (H heads, R = kv_lora_rank, Dr = qk_rope_head_dim, nope = qk_nope_head_dim,
V = v_head_dim, qk = nope + Dr):

    q    = q_b_proj(RMSNorm(q_a_proj(x)))  (q_lora_rank set) or q_proj(x)  -> [H, nope | Dr]
    kv_a = kv_a_proj_with_mqa(x)                                         -> [R | Dr]
    c_kv = RMSNorm(kv_a[:R]) (kv_a_layernorm),  k_pe = RoPE(kv_a[R:])   (one key shared by all heads)
    q_pe = RoPE(q[:, nope:])
    cache row = [c_kv | k_pe]                                             (`backend/latent_kv_cache.py`)
    kv_b_proj: c_kv -> per head [k_nope (nope) | v (V)],  W = [H, nope + V, R]
    out  = o_proj(concat_h softmax(scale * q_h . k_h) v_h)

q_a_proj and kv_a_proj_with_mqa (or q_proj and kv_a_proj_with_mqa) read the same x, so they
are fused at load into one GEMM (`a_proj`). The softmax scale is `cfg.mla_softmax_scale`
(qk^-0.5, times the YaRN mscale squared); the YaRN attention factor on cos/sin comes
from `backend/rope.py`.

Two ways to compute the same attention (equal up to float rounding):

- **Non-absorbed** (prefill, and decode when `absorb` is off): gather the context's
  rows, expand c_kv with kv_b_proj into per-head k_nope and v, broadcast k_pe to
  every head, and run ordinary attention with qk-dim keys; causal with the cached
  prefix for a prompt chunk. Costs a [ctx, R] x [R, H (nope + V)] GEMM per chunk.
- **Absorbed** (decode): since q_h . k_nope_h = (W_UK_h^T q_nope_h) . c_kv and
  sum_j p_j v_hj = W_UV_h (sum_j p_j c_kv_j), fold W_UK [H, nope, R] into the query
  (q_latent = q_nope @ W_UK, [H, R]) and W_UV [H, R, V] after attention: every head
  then attends over the cached rows themselves, ONE KV head of R + Dr dims whose
  values are c_kv (multi-query attention with q = [q_latent | q_pe]). Per decode token
  this reads each cached row once instead of expanding it per head. On CUDA the
  Triton kernel `kernels/mla_decode.py` reads (and dequantises) the pages in place.

kv_b_proj is read dense (an FP8 block-scaled checkpoint's is dequantised at load) and
kept three ways: the [H (nope + V), R] GEMM for the expansion, and contiguous W_UK and
W_UV for absorption.

RoPE: pages hold k_pe in the interleaved-pair order of `backend/rope.py`. Checkpoints
with rope_interleave=True already store q/k rope rows in that order; rope_interleave=False
ones (NeoX halves) get their q and k_pe projection rows reordered at load.

DeepSeek sparse attention (GLM-5) hooks in through `select`: called with the layer
input x [T, hidden] and the normed query latent qr [T, q_lora_rank], it returns a
`KeySelection`, an extra mask (keys not selected are excluded) applied on both paths.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from backend.attention import StepMetadata
from backend.config import ModelConfig
from backend.layers.attention import run_linear
from backend.layers.loader import WeightLoader
from backend.layers.norm import rms_norm
from backend.linear import Linear, LinearOp
from backend.rope import RotaryEmbedding, interleave_rope_rows

__all__ = ["KeySelection", "MLAWeights", "load_mla", "mla_attention"]


class KeySelection(NamedTuple):
    """Keys each query may attend to (DSA top-k), as masks over the keys attention sees."""

    decode: torch.Tensor | None  # [D, P * page_size] bool over decode_page_table's padded keys
    chunks: list[torch.Tensor]  # per prefill chunk [n, ctx] bool


Selector = Callable[[torch.Tensor, torch.Tensor | None], KeySelection]


class MLAWeights:
    """One layer's MLA weights in one linear format. The linears (a_proj, q_b, o_proj) are per
    format; the norms and the kv_b_proj forms are dense and shared between formats.

    `selector`, when set (DSA models), is called as selector(x, qr, cache, layer, meta, freqs)
    (freqs: the step's RoPE table, `RotaryEmbedding.tables`) and returns the step's
    `KeySelection` for this layer."""

    def __init__(self, a_proj: LinearOp, q_b: LinearOp | None, o_proj: LinearOp, q_a_norm: torch.Tensor | None,
                 kv_a_norm: torch.Tensor, kv_b: Linear, w_uk: torch.Tensor, w_uv: torch.Tensor) -> None:
        self.a_proj = a_proj  # [q_lora_rank (or H * qk) + R + Dr, hidden]
        self.q_b = q_b  # [H * qk, q_lora_rank], None without q_lora_rank
        self.o_proj = o_proj  # [hidden, H * V]
        self.q_a_norm = q_a_norm  # [q_lora_rank]
        self.kv_a_norm = kv_a_norm  # [R]
        self.kv_b = kv_b  # [H * (nope + V), R]
        self.w_uk = w_uk  # [H, nope, R]
        self.w_uv = w_uv  # [H, R, V]
        self.selector: Callable[..., KeySelection] | None = None

    def linears(self) -> list[LinearOp]:
        """The per-format linears (what a second phase format holds again)."""
        return [w for w in (self.a_proj, self.q_b, self.o_proj) if w is not None]

    def shared_tensors(self) -> list[torch.Tensor]:
        """Dense tensors shared by every format: norms, kv_b_proj, W_UK, W_UV."""
        return [t for t in (self.q_a_norm, self.kv_a_norm, self.kv_b.weight, self.w_uk, self.w_uv) if t is not None]


def _rope_row_perm(num_heads: int, head_dim: int, rope_dim: int) -> torch.Tensor:
    """Row order [head_dim * num_heads] that turns each head's last `rope_dim` rows from halves
    into interleaved pairs (the other rows kept)."""
    perm = torch.arange(num_heads * head_dim).view(num_heads, head_dim)
    rope = perm[:, head_dim - rope_dim:].reshape(-1)
    perm[:, head_dim - rope_dim:] = interleave_rope_rows(rope, num_heads, rope_dim).view(num_heads, rope_dim)
    return perm.reshape(-1)


def load_mla(loader: WeightLoader, prefix: str) -> dict[str, MLAWeights]:
    """One `MLAWeights` per target format for `<prefix>self_attn.`: q_a_proj + q_a_layernorm +
    q_b_proj (or q_proj), kv_a_proj_with_mqa + kv_a_layernorm, kv_b_proj, o_proj (+ the biases
    of q_a_proj, kv_a_proj_with_mqa and o_proj when config.attention_bias and present)."""
    cfg = loader.cfg
    p = f"{prefix}self_attn."
    h, hidden, ql = cfg.num_heads, cfg.hidden_size, cfg.q_lora_rank
    r, dr, nope, v = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    qk = nope + dr
    reorder = not cfg.rope_interleave  # NeoX-halves rope rows -> the interleaved pairs the pages hold
    q_perm = _rope_row_perm(h, qk, dr) if reorder else None
    kv_perm = _rope_row_perm(1, r + dr, dr) if reorder else None
    q_first = (f"{p}q_a_proj", (ql, hidden), None) if ql else (f"{p}q_proj", (h * qk, hidden), q_perm)
    kv_a = (f"{p}kv_a_proj_with_mqa", (r + dr, hidden), kv_perm)

    def bias_of(module: str, rows: int, perm: torch.Tensor | None) -> torch.Tensor:
        if f"{module}.bias" not in loader:
            return torch.zeros(rows, dtype=loader.dtype, device=loader.device)
        b = loader.get(f"{module}.bias")
        return b[perm.to(b.device)] if perm is not None else b

    a_bias = None
    if cfg.attention_bias and (f"{q_first[0]}.bias" in loader or f"{kv_a[0]}.bias" in loader):
        a_bias = torch.cat([bias_of(q_first[0], q_first[1][0], q_first[2]), bias_of(kv_a[0], r + dr, kv_perm)])
    a_proj = loader.linears([(m, shape, 0 if perm is None else perm) for m, shape, perm in (q_first, kv_a)], a_bias)
    q_b = loader.linears([(f"{p}q_b_proj", (h * qk, ql), 0 if q_perm is None else q_perm)]) if ql else None
    o_bias = loader.get(f"{p}o_proj.bias") if cfg.attention_bias and f"{p}o_proj.bias" in loader else None
    o_proj = loader.linears([(f"{p}o_proj", (hidden, h * v), 0)], o_bias)
    q_a_norm = loader.get(f"{p}q_a_layernorm.weight") if ql else None
    kv_a_norm = loader.get(f"{p}kv_a_layernorm.weight")
    src, sw = loader.read(f"{p}kv_b_proj", (h * (nope + v), r))
    w = src.dequantize(sw).to(device=loader.device, dtype=loader.dtype).contiguous()  # [H (nope + V), R]
    per_head = w.view(h, nope + v, r)
    w_uk = per_head[:, :nope].contiguous()  # [H, nope, R]
    w_uv = per_head[:, nope:].transpose(1, 2).contiguous()  # [H, R, V]
    kv_b = Linear(w, None, loader.gemm_buckets)
    return {key: MLAWeights(a_proj[key], q_b[key] if q_b else None, o_proj[key], q_a_norm, kv_a_norm, kv_b, w_uk,
                            w_uv)
            for key in loader.targets}


def mla_attention(cfg: ModelConfig, w: MLAWeights, dec: MLAWeights, x: torch.Tensor, split: int,
                  freqs: torch.Tensor, cache: Any, layer: int, meta: StepMetadata, absorb: bool = True,
                  select: Selector | None = None) -> torch.Tensor:
    """MLA output [T, hidden] of x [T, hidden] (normed), storing this step's latent rows into
    `cache` (a `LatentKVCache`). `split`: a mixed step's first rows run the decode-format
    linears of `dec` (see `run_linear`). `absorb`: decode rows use weight absorption (else the
    non-absorbed expansion). `select`: the DSA key selection, an extra mask (see module doc)."""
    t = x.shape[0]
    h, r, dr, nope = cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim
    a = run_linear(w.a_proj, dec.a_proj, x, split)  # [T, q_lora_rank (or H * qk) + R + Dr]
    qr = None
    if w.q_b is not None:
        qr = rms_norm(a[:, : cfg.q_lora_rank], w.q_a_norm, cfg.rms_norm_eps)  # [T, q_lora_rank]
        q = run_linear(w.q_b, dec.q_b, qr, split)
    else:
        q = a[:, : h * (nope + dr)].contiguous()
    q = q.view(t, h, nope + dr)
    q[..., nope:] = RotaryEmbedding.apply(q[..., nope:], freqs)  # q = [q_nope | roped q_pe]
    c_kv = rms_norm(a[:, -(r + dr): -dr], w.kv_a_norm, cfg.rms_norm_eps)  # [T, R]
    k_pe = RotaryEmbedding.apply(a[:, -dr:].unsqueeze(1), freqs).squeeze(1)  # [T, Dr]
    cache.store(layer, meta.slots, c_kv, k_pe)
    selection = select(x, qr) if select is not None else None
    scale = cfg.mla_softmax_scale
    d = meta.num_decode
    kernel = q.is_cuda and selection is None  # the Triton decode kernel (it takes no key selection)
    if d and not meta.prefills:  # a pure decode step: no scatter into a shared output
        out = _decode(cfg, w, q, cache, layer, meta, scale, absorb, selection, kernel)
    else:
        out = q.new_empty(t, h, cfg.v_head_dim)
        if d:
            out[:d] = _decode(cfg, w, q[:d], cache, layer, meta, scale, absorb, selection, kernel)
        for i, chunk in enumerate(meta.prefills):
            rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
            out[rows] = _prefill_chunk(cfg, w, q[rows], cache, layer, chunk, scale,
                                       selection.chunks[i] if selection is not None else None)
    return run_linear(w.o_proj, dec.o_proj, out.reshape(t, -1), split)


def _expand(cfg: ModelConfig, w: MLAWeights, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head keys [..., H, qk] and values [..., H, V] of cached rows [..., R + Dr] (non-absorbed)."""
    h, r, nope = cfg.num_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim
    lead = rows.shape[:-1]
    kv = w.kv_b(rows[..., :r].reshape(-1, r)).view(*lead, h, nope + cfg.v_head_dim)
    k_pe = rows[..., r:].unsqueeze(-2).expand(*lead, h, cfg.qk_rope_head_dim)
    return torch.cat([kv[..., :nope], k_pe], dim=-1), kv[..., nope:]


def _decode(cfg: ModelConfig, w: MLAWeights, q: torch.Tensor, cache: Any, layer: int, meta: StepMetadata,
            scale: float, absorb: bool, selection: KeySelection | None, kernel: bool) -> torch.Tensor:
    """Attention output [D, H, V] of the decode rows' queries q [D, H, qk] over their pages (absorbed:
    through the Triton kernel when `kernel`, which takes no selection, else torch)."""
    d, r, nope = q.shape[0], cfg.kv_lora_rank, cfg.qk_nope_head_dim
    keep = selection.decode if selection is not None else None
    mask = meta.decode_mask  # [D, 1, 1, P * page_size] additive: keys past each context length
    if keep is not None:
        mask = mask.masked_fill(~keep.view(d, 1, 1, -1), float("-inf"))
    if not absorb:
        k, v = _expand(cfg, w, cache.gather(layer, meta.decode_page_table))  # [D, L, H, qk], [D, L, H, V]
        o = F.scaled_dot_product_attention(q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                           scale=scale)  # [D, H, 1, V]
        return o.squeeze(2)
    q_latent = torch.bmm(q[..., :nope].transpose(0, 1), w.w_uk).transpose(0, 1)  # [D, H, R]
    if kernel and keep is None:
        from kernels.mla_decode import mla_decode_attention

        out_latent = mla_decode_attention(q_latent.contiguous(), q[..., nope:].contiguous(), cache.layer(layer),
                                          cache.format_name, r, cfg.qk_rope_head_dim,
                                          meta.decode_page_table.to(torch.int32), meta.decode_context_lens, scale)
    else:
        rows = cache.gather(layer, meta.decode_page_table).unsqueeze(1)  # [D, 1, L, R + Dr]: one KV head
        q_full = torch.cat([q_latent, q[..., nope:]], dim=-1).unsqueeze(1)  # [D, 1, H, R + Dr]: H query rows
        out_latent = F.scaled_dot_product_attention(q_full, rows, rows[..., :r], attn_mask=mask,
                                                    scale=scale).squeeze(1)  # [D, H, R]
    return torch.bmm(out_latent.transpose(0, 1), w.w_uv).transpose(0, 1)  # [D, H, V]


def _prefill_chunk(cfg: ModelConfig, w: MLAWeights, q: torch.Tensor, cache: Any, layer: int, chunk: Any,
                   scale: float, keep: torch.Tensor | None) -> torch.Tensor:
    """Attention output [n, H, V] of one prompt chunk's queries q [n, H, qk] (non-absorbed):
    query i sits at position ctx - n + i and sees keys 0..ctx - n + i (and, with a DSA
    selection, only the selected ones)."""
    n, ctx = chunk.num_tokens, chunk.context_len
    rows = cache.gather(layer, chunk.page_table)[0, :ctx]  # [ctx, R + Dr]
    k, v = _expand(cfg, w, rows)  # [ctx, H, qk], [ctx, H, V]
    qpos = torch.arange(ctx - n, ctx, device=q.device).unsqueeze(1)  # [n, 1]
    mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= qpos  # [n, ctx], causal with the cached prefix
    if keep is not None:
        mask = mask & keep
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                       scale=scale)  # [H, n, V]
    return o.transpose(0, 1)
