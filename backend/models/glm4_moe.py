"""GLM-4.5 / 4.6 / 4.7 (`Glm4MoeForCausalLM`): GQA attention + dense then mixture-of-experts MLPs.

Attention: q/k/v biases when `attention_bias` (o_proj has none), per-head q/k RMSNorm
before RoPE when `use_qk_norm`, partial rotary (`partial_rotary_factor`, 0.5 by
default: NeoX rotation of each head's first half, the rest passed through),
head_dim from the config, scale head_dim^-0.5. MLP: layers below
`first_k_dense_replace` use a dense SwiGLU MLP of `intermediate_size`
(`mlp.{gate,up,down}_proj`), the others a MoE block (`layers/experts.py`: sigmoid
router with correction bias and group-limited top-k, routed SwiGLU experts of
`moe_intermediate_size`, shared experts added unscaled).

Multi-token-prediction layers (`num_nextn_predict_layers`, stored as extra layers
`model.layers.{num_hidden_layers}.*`) are not run and not loaded.
"""

from __future__ import annotations

import logging

from backend.layers.attention import load_attention
from backend.layers.feed_forward import load_feed_forward, log_mtp_layers
from backend.layers.loader import WeightLoader
from backend.model import LayerWeights

__all__ = ["load_layers"]

log = logging.getLogger(__name__)


def load_layers(loader: WeightLoader) -> dict[str, list[LayerWeights]]:
    """The decoder layers, one list per target format (`loader.targets`)."""
    cfg = loader.cfg
    log_mtp_layers(loader, log)
    layers: dict[str, list[LayerWeights]] = {key: [] for key in loader.targets}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        attn = load_attention(loader, p)
        mlps = load_feed_forward(loader, i)
        input_norm = loader.get(f"{p}input_layernorm.weight")
        post_norm = loader.get(f"{p}post_attention_layernorm.weight")
        for key in loader.targets:
            layers[key].append(LayerWeights(input_norm, attn.qkv[key], attn.o_proj[key], post_norm,
                                            qk_norm=attn.qk_norm, **mlps[key]))
    return layers
