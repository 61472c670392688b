"""The feed-forward half of a MoE family's decoder layer, and the layers such checkpoints store
but the runtime does not run.

Glm4Moe, DeepseekV3 / Kimi K2.x and GlmMoeDsa share it: layers below
`first_k_dense_replace` use a dense SwiGLU MLP of `intermediate_size`
(`mlp.{gate,up,down}_proj`, `layers/mlp.py`), the others a MoE block (`layers/experts.py`).
Their checkpoints may also hold multi-token-prediction layers after the last one
(`model.layers.{num_hidden_layers}.*`), which are neither run nor loaded.
"""

from __future__ import annotations

import logging
from typing import Any

from backend.layers.experts import load_moe
from backend.layers.loader import WeightLoader
from backend.layers.mlp import load_mlp

__all__ = ["load_feed_forward", "log_mtp_layers"]


def load_feed_forward(loader: WeightLoader, layer: int) -> dict[str, dict[str, Any]]:
    """Per target format, the `LayerWeights` fields of layer `layer`'s MLP: {"moe": block} on a MoE
    layer (`cfg.is_moe_layer`), else {"gate_up": ..., "down": ...}."""
    cfg, p = loader.cfg, f"model.layers.{layer}."
    if cfg.is_moe_layer(layer):
        moe = load_moe(loader, p)
        return {key: {"moe": moe[key]} for key in loader.targets}
    gate_up, down = load_mlp(loader, f"{p}mlp.", cfg.intermediate_size)
    return {key: {"gate_up": gate_up[key], "down": down[key]} for key in loader.targets}


def log_mtp_layers(loader: WeightLoader, log: logging.Logger) -> None:
    """One info line on `log` naming the multi-token-prediction layers the checkpoint stores after
    the last layer (skipped: not run, not loaded); nothing when there are none."""
    cfg = loader.cfg
    mtp = sorted({n.split(".")[2] for n in loader.ckpt.names()
                  if n.startswith("model.layers.") and int(n.split(".")[2]) >= cfg.num_layers})
    if mtp:
        log.info("skipping %d multi-token-prediction layer(s) stored as model.layers.%s (not run)", len(mtp),
                 ",".join(mtp))
