"""DeepSeek sparse attention (DSA): the lightning indexer that picks which keys each query attends to.

GLM-5.x (`GlmMoeDsaForCausalLM`) and DeepSeek-V3.2 run MLA over a subset of the
context: for every query a small "indexer" scores all causal keys and MLA then
attends to the `index_topk` best only (all of them while a sequence is shorter).
Per layer with its own indexer ("full" in `cfg.indexer_types`):

    q   = wq_b(qr)                         [T, n_heads, index_head_dim]   qr = q_a_layernorm(q_a_proj(x))
    k   = LayerNorm(wk(x)) (eps 1e-6)      [T, index_head_dim]            stored in the indexer key cache
    RoPE on the FIRST qk_rope_head_dim dims of q and k (the rest pass through)
    w   = weights_proj(x) in float32       [T, n_heads]
    score[t, s] = sum_h relu(q_h[t] . k[s] * index_head_dim^-0.5) * w_h[t] * n_heads^-0.5
    selected[t] = top-index_topk keys s <= position(t) by score (every causal key when fewer)

"shared" layers (GLM-5.2's IndexShare) have no indexer weights and reuse the selection
of the last "full" layer of the same forward step (`IndexerStep` holds it).

Numerics:
- The keys are scored as the cache holds them, in prefill and in decode alike: the
  store happens first and every score reads the keys back from `IndexerKeyCache`
  (FP8 e4m3 with one float32 scale per token, see `backend/indexer_cache.py`), as
  vLLM's and SGLang's indexers do. transformers scores the un-quantised key in
  prefill (and keeps float keys in its cache), so with FP8 keys our selection can
  differ from it where two keys' scores nearly tie; with an ``fp32`` key cache it is
  the same computation. tests/backend/test_dsa_indexer.py measures how often the
  selected sets agree. Queries and head weights stay float32 (not quantised).
- Scores are computed in float32 whatever the compute dtype: the weights_proj output
  is cast to float32 (bf16 ties flip the top-k), q and the keys are float32.
- RoPE: our `RotaryEmbedding` rotates adjacent pairs (x0,x1),(x2,x3)... GLM-5 checkpoints
  (`indexer_rope_interleave` true) already store them so; for split-half checkpoints
  (DeepSeek-V3.2's indexer) the rope rows of wq_b (per head), wk and the k_norm
  weight/bias are reordered at load (`interleave_rope_rows`). LayerNorm does not care
  about order, and q.k is unchanged because q and k are reordered alike; the cached key
  bytes are therefore in interleaved-pair order.
- Ties: keys with exactly equal scores are broken by `torch.topk`'s order, as in
  transformers; an exact tie at the top-k boundary is the only case where two correct
  implementations may pick different keys.

Weights are held in the prefill weight format (one copy: the indexer is ~1% of the
model's weights and only ranks keys), weights_proj dense float32 as transformers keeps it.

Tensor parallelism: the indexer is replicated, not split (`backend/distributed/sharding.py`
says why: splitting its heads would all-reduce [tokens, keys] scores per full layer). Every
rank reads its weights whole, keeps its own copy of the key cache (stored from the same
replicated inputs, so byte-identical to rank 0's), and computes the same selection; its
heads of MLA then attend over exactly those keys. `load_indexer` reads `loader.cfg`, the
rank's local view, whose indexer fields are the whole model's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from backend.attention import StepMetadata
from backend.config import ModelConfig
from backend.errors import ModelLoadError
from backend.indexer_cache import IndexerKeyCache
from backend.layers.loader import WeightLoader
from backend.layers.mla import KeySelection
from backend.linear import LinearOp
from backend.rope import RotaryEmbedding, interleave_rope_rows

__all__ = ["IndexerWeights", "IndexerStep", "DsaSelector", "load_indexer", "index_scores", "top_k_mask", "build_selection"]

LAYERNORM_EPS = 1e-6  # the indexer's k_norm (nn.LayerNorm(index_head_dim, eps=1e-6))
SCORE_BLOCK = 1 << 24  # float32 elements of one [query rows, heads, keys] score block (64 MiB): rows go in blocks


@dataclass
class IndexerWeights:
    """One "full" layer's indexer."""

    wq_b: LinearOp  # [n_heads * index_head_dim, q_lora_rank], rope rows interleaved per head
    wk: LinearOp  # [index_head_dim, hidden], rope rows interleaved
    k_norm_weight: torch.Tensor  # [index_head_dim] float32
    k_norm_bias: torch.Tensor  # [index_head_dim] float32
    weights_proj: torch.Tensor  # [n_heads, hidden] float32


def load_indexer(loader: WeightLoader, layer: int) -> IndexerWeights | None:
    """`model.layers.{layer}.self_attn.indexer.{wq_b, wk, k_norm, weights_proj}`; None for a
    "shared" layer (it reuses the last full layer's selection and has no indexer weights)."""
    cfg = loader.cfg
    if cfg.indexer_types[layer] == "shared":
        return None
    p = f"model.layers.{layer}.self_attn.indexer."
    if cfg.q_lora_rank is None:
        raise ModelLoadError("the DSA indexer needs q_lora_rank (its wq_b reads the q latent)")
    heads, dim, rot = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
    if rot > dim or rot % 2:
        raise ModelLoadError(f"index_head_dim {dim} must hold the even qk_rope_head_dim {rot}")
    def linear(name: str, shape: tuple[int, int], rope_heads: int) -> LinearOp:
        src, sw = loader.read(f"{p}{name}", shape)
        fmt = loader.target_format([src], loader.formats["prefill"])  # stored dense stays dense
        sw = loader.convert(src, sw, fmt)
        if not cfg.indexer_rope_interleave:
            sw = fmt.permute_rows(sw, interleave_rope_rows(torch.arange(shape[0]), rope_heads, dim, rot))
        return fmt.linear(sw, None, loader.dtype, loader.gemm_buckets)

    def dense(name: str) -> torch.Tensor:
        src, sw = loader.read(name)
        return src.dequantize(sw).to(device=loader.device, dtype=torch.float32).contiguous()

    norm_w, norm_b = (loader.get(f"{p}k_norm.{n}").float() for n in ("weight", "bias"))
    if not cfg.indexer_rope_interleave:
        norm_w, norm_b = (interleave_rope_rows(t, 1, dim, rot) for t in (norm_w, norm_b))
    weights_proj = dense(f"{p}weights_proj")
    if weights_proj.shape != (heads, cfg.hidden_size):
        raise ModelLoadError(f"{p}weights_proj has shape {list(weights_proj.shape)}, "
                             f"the config needs {[heads, cfg.hidden_size]}")
    return IndexerWeights(linear("wq_b", (heads * dim, cfg.q_lora_rank), heads),
                          linear("wk", (dim, cfg.hidden_size), 1), norm_w, norm_b, weights_proj)


def index_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Indexer scores [..., n, L] (float32) of queries q [..., n, H, D] against keys [..., L, D],
    head weights [..., n, H] (already times n_heads^-0.5): sum_h relu(q_h . k * D^-0.5) * w_h."""
    scale = q.shape[-1] ** -0.5
    # [..., n, H, D] @ [..., 1, D, L] -> [..., n, H, L]
    s = torch.matmul(q.float(), keys.float().transpose(-1, -2).unsqueeze(-3)).mul_(scale).relu_()
    return torch.matmul(weights.float().unsqueeze(-2), s).squeeze(-2)  # [..., n, L]


def top_k_mask(scores: torch.Tensor, allowed: torch.Tensor, k: int) -> torch.Tensor:
    """Bool [..., L]: the k highest `scores` among the `allowed` keys of each row (all allowed
    keys where a row has at most k)."""
    length = scores.shape[-1]
    if length <= k:
        return allowed.clone()
    idx = scores.masked_fill(~allowed, float("-inf")).topk(k, dim=-1).indices
    return torch.zeros_like(allowed).scatter_(-1, idx, True) & allowed


def _top_k_rows(q: torch.Tensor, keys: torch.Tensor, hw: torch.Tensor, allowed: torch.Tensor,
                k: int) -> torch.Tensor:
    """top_k_mask [n, L] of queries q [n, H, D] with head weights hw [n, H] against keys [L, D]
    (shared by every row: a prompt chunk) or [n, L, D] (one table per row: decode rows),
    scored a block of rows at a time so the [rows, H, L] intermediate stays under SCORE_BLOCK."""
    n, heads = q.shape[:2]
    per_row = keys.dim() == 3
    block = max(1, SCORE_BLOCK // (heads * allowed.shape[-1]))
    out = []
    for i in range(0, n, block):
        r = slice(i, i + block)
        if per_row:
            scores = index_scores(q[r].unsqueeze(1), keys[r], hw[r].unsqueeze(1)).squeeze(1)
        else:
            scores = index_scores(q[r], keys, hw[r])
        out.append(top_k_mask(scores, allowed[r], k))
    return torch.cat(out)


def build_selection(cfg: ModelConfig, w: IndexerWeights, x: torch.Tensor, qr: torch.Tensor,
                    freqs: torch.Tensor, meta: StepMetadata, cache: IndexerKeyCache, layer: int) -> KeySelection:
    """The keys each of the step's queries attends to, from one full layer's indexer.

    x [T, hidden] is the layer's (normed) input, qr [T, q_lora_rank] the normed q latent,
    freqs the step's RoPE tables. Stores this step's indexer keys at `meta.slots` of
    `layer` (mutates the cache there only), then scores every query against its causal
    keys as cached. Returns masks over the keys `mla_attention` reads: decode rows over
    `meta.decode_page_table`'s padded keys, each prompt chunk over its first context_len keys."""
    t = x.shape[0]
    heads, dim, topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
    k = F.layer_norm(w.wk(x).float(), (dim,), w.k_norm_weight, w.k_norm_bias, LAYERNORM_EPS)
    k = RotaryEmbedding.apply(k.unsqueeze(1), freqs).squeeze(1)  # [T, dim]
    cache.store(layer, meta.slots, k)
    needs_scores = (meta.num_decode and meta.decode_page_table.shape[1] * cache.page_size > topk) or any(
        c.context_len > topk for c in meta.prefills)
    if needs_scores:
        q = RotaryEmbedding.apply(w.wq_b(qr).float().view(t, heads, dim), freqs)  # [T, heads, dim]
        hw = F.linear(x.float(), w.weights_proj) * heads ** -0.5  # [T, heads] float32
    decode = None
    d = meta.num_decode
    if d:
        length = meta.decode_page_table.shape[1] * cache.page_size
        positions = torch.arange(length, device=x.device)
        allowed = positions.unsqueeze(0) < meta.decode_context_lens.to(x.device).unsqueeze(1)  # [D, L]
        if length > topk:
            keys = cache.gather(layer, meta.decode_page_table)  # [D, L, dim]
            decode = _top_k_rows(q[:d], keys, hw[:d], allowed, topk)
        else:
            decode = allowed
    chunks = []
    for c in meta.prefills:
        n, ctx = c.num_tokens, c.context_len
        qpos = torch.arange(ctx - n, ctx, device=x.device).unsqueeze(1)  # [n, 1]
        allowed = torch.arange(ctx, device=x.device).unsqueeze(0) <= qpos  # [n, ctx], causal with the prefix
        if ctx > topk:
            rows = slice(c.token_start, c.token_start + n)
            keys = cache.gather(layer, c.page_table)[0, :ctx]  # [ctx, dim]
            chunks.append(_top_k_rows(q[rows], keys, hw[rows], allowed, topk))
        else:
            chunks.append(allowed)
    return KeySelection(decode, chunks)


class IndexerStep:
    """The indexer's state for one forward step: which selection "shared" layers reuse.

    `step.selector(i, indexer_weights_of_layer_i)` is the `select(x, qr)` that `mla_attention`
    calls for layer i: a full layer's computes and remembers its selection, a shared layer's
    returns the last one remembered (layers run in order, the first is always full)."""

    def __init__(self, cfg: ModelConfig, meta: StepMetadata, cache: IndexerKeyCache, freqs: torch.Tensor) -> None:
        self.cfg, self.meta, self.cache, self.freqs = cfg, meta, cache, freqs
        self.last: KeySelection | None = None

    def selector(self, layer: int, weights: IndexerWeights | None) -> Callable[[torch.Tensor, torch.Tensor],
                                                                                 KeySelection]:
        """`select(x, qr) -> KeySelection` for `layer` (weights None: a shared layer)."""

        def select(x: torch.Tensor, qr: torch.Tensor) -> KeySelection:
            if weights is None:
                if self.last is None:
                    raise ModelLoadError(f"layer {layer} shares a DSA selection but no full layer precedes it")
                return self.last
            self.last = build_selection(self.cfg, weights, x, qr, self.freqs, self.meta, self.cache, layer)
            return self.last

        return select


class DsaSelector:
    """The model's DSA hook: one per model, one `layer_selector` per layer for `MLAWeights.selector`.

    The MLA layer calls `selector(x, qr, cache, layer, meta, freqs)` (cache: the
    `LatentKVCache`, whose `indexer` holds the keys; freqs: the step's RoPE table, the same
    the MLA rope uses, since the indexer rotates qk_rope_head_dim dims too). A new `meta`
    object starts a new `IndexerStep`, so a shared layer only ever reuses a selection of its
    own step."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg
        self._step: IndexerStep | None = None

    def step(self, meta: StepMetadata, cache: IndexerKeyCache, freqs: torch.Tensor) -> IndexerStep:
        """The step `meta` belongs to (a new one for a new metadata object)."""
        if self._step is None or self._step.meta is not meta or self._step.cache is not cache:
            self._step = IndexerStep(self.cfg, meta, cache, freqs)
        return self._step

    def layer_selector(self, weights: IndexerWeights | None) -> Callable[..., KeySelection]:
        """`selector(x, qr, cache, layer, meta, freqs) -> KeySelection` for a layer with these
        indexer weights (None: a "shared" layer)."""

        def selector(x: torch.Tensor, qr: torch.Tensor, cache: Any, layer: int, meta: StepMetadata,
                     freqs: torch.Tensor) -> KeySelection:
            if cache.indexer is None:
                raise ModelLoadError("a DSA model needs a latent KV cache with an indexer key cache")
            return self.step(meta, cache.indexer, freqs).selector(layer, weights)(x, qr)

        return selector
