"""GLM-5.x (`GlmMoeDsaForCausalLM`): DeepSeek-V3-style MLA + MoE with DeepSeek sparse attention.

Everything but the key selection is DeepSeek-V3's wiring (`backend/models/deepseek_v3.py`:
MLA over the paged latent KV cache with interleaved RoPE, dense MLPs below
`first_k_dense_replace`, the sigmoid-routed MoE block above), and is loaded by it. On
top, every layer's MLA attends only to the keys its DSA selection keeps
(`backend/layers/dsa_indexer.py`): "full" layers (`cfg.indexer_types`) run their own
lightning indexer (`model.layers.{i}.self_attn.indexer.{wq_b, wk, k_norm, weights_proj}`),
"shared" layers (GLM-5.2's IndexShare; no indexer tensors) reuse the selection of the
last full layer of the same step. The indexer's keys live in the latent KV cache's
`indexer` key cache (`backend/indexer_cache.py`, FP8 by default) on the same slots.

A sequence no longer than `index_topk` (2048 for GLM-5) attends to every key, so short
prompts are plain MLA; the indexer still stores its keys for when the sequence grows.

Under tensor parallelism the MLA and MoE parts are split as DeepSeek-V3's are and the
indexer is replicated on every rank (each computes the same selection from the same
replicated inputs; see `backend/layers/dsa_indexer.py`).
"""

from __future__ import annotations

from backend.layers.dsa_indexer import DsaSelector, load_indexer
from backend.layers.loader import WeightLoader
from backend.model import LayerWeights
from backend.models import deepseek_v3

__all__ = ["load_layers"]


def load_layers(loader: WeightLoader) -> dict[str, list[LayerWeights]]:
    """The decoder layers, one list per target format (`loader.targets`), each MLA bound to its
    layer's DSA selector."""
    layers = deepseek_v3.load_layers(loader)
    selector = DsaSelector(loader.cfg)
    for i in range(loader.cfg.num_layers):
        select = selector.layer_selector(load_indexer(loader, i))
        for per_format in layers.values():
            per_format[i].mla.selector = select
    return layers
