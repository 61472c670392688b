"""Llama and Qwen2 (and SmolLM2, a Llama): every layer GQA attention + a dense SwiGLU MLP.

Checkpoint names (Hugging Face), per layer `model.layers.{i}.`:
`input_layernorm.weight`, `self_attn.{q,k,v,o}_proj.weight` (Qwen2 and
`attention_bias`: `self_attn.{q,k,v}_proj.bias`), `post_attention_layernorm.weight`,
`mlp.{gate,up,down}_proj.weight`.
"""

from __future__ import annotations

from backend.layers.attention import load_attention
from backend.layers.loader import WeightLoader
from backend.layers.mlp import load_mlp
from backend.model import LayerWeights

__all__ = ["load_layers"]


def load_layers(loader: WeightLoader) -> dict[str, list[LayerWeights]]:
    """The decoder layers, one list per target format (`loader.targets`)."""
    cfg = loader.cfg
    layers: dict[str, list[LayerWeights]] = {key: [] for key in loader.targets}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        attn = load_attention(loader, p)
        gate_up, down = load_mlp(loader, f"{p}mlp.", cfg.intermediate_size)
        input_norm = loader.get(f"{p}input_layernorm.weight")
        post_norm = loader.get(f"{p}post_attention_layernorm.weight")
        for key in loader.targets:
            layers[key].append(LayerWeights(input_norm, attn.qkv[key], attn.o_proj[key], post_norm,
                                            gate_up=gate_up[key], down=down[key], qk_norm=attn.qk_norm))
    return layers
