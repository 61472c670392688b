"""DeepSeek-V3 (`DeepseekV3ForCausalLM`) and Kimi K2.x (`Kimi_K25ForConditionalGeneration`'s text
backbone): multi-head latent attention + dense then mixture-of-experts MLPs.

Attention: MLA over the paged latent KV cache (`layers/mla.py`: q_lora_rank optional,
interleaved RoPE, YaRN with the mscale correction on the softmax scale; prefill
non-absorbed, decode absorbed). MLP: layers below `first_k_dense_replace` use a dense
SwiGLU MLP of `intermediate_size` (`mlp.{gate,up,down}_proj`), the others a MoE block
(`layers/experts.py`: sigmoid router with correction bias and group-limited top-k,
routed SwiGLU experts of `moe_intermediate_size`, shared experts added unscaled),
the same block as Glm4Moe.

Checkpoint names per layer `model.layers.{i}.` (Kimi K2.5/K2.6 store them under
`language_model.`, which the checkpoint reader strips from `checkpoint_prefix`; it logs
and skips the vision tower beside it):
`input_layernorm.weight`, `post_attention_layernorm.weight`,
`self_attn.{q_a_proj, q_b_proj | q_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj}.weight`,
`self_attn.{q_a_layernorm, kv_a_layernorm}.weight`, then the MLP's.
Multi-token-prediction layers (`model.layers.{num_hidden_layers}.*`) are not run and not loaded.
"""

from __future__ import annotations

import logging

from backend.layers.feed_forward import load_feed_forward, log_mtp_layers
from backend.layers.loader import WeightLoader
from backend.layers.mla import load_mla
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
        mla = load_mla(loader, p)
        mlps = load_feed_forward(loader, i)
        input_norm = loader.get(f"{p}input_layernorm.weight")
        post_norm = loader.get(f"{p}post_attention_layernorm.weight")
        for key in loader.targets:
            layers[key].append(LayerWeights(input_norm, mla[key].a_proj, mla[key].o_proj, post_norm, mla=mla[key],
                                            **mlps[key]))
    return layers
