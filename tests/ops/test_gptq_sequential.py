"""True-sequential calibration (`ops.calibration.LayerCalibrator`): within a layer, o_proj is calibrated on the
attention output of the *quantised* q/k/v, and down_proj on the MLP inner activations of the *quantised*
gate/up, so each linear's Hessian is built from the inputs the quantised model will give it."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from backend.config import load_config
from backend.weight_formats import Int4Format
from backend.weights import CheckpointReader
from ops import quantize
from ops.calibration import LayerCalibrator


def test_each_sub_layer_is_calibrated_on_the_quantised_previous_sub_layers_outputs(tiny_chat_dir: Path) -> None:
    cfg = load_config(tiny_chat_dir)
    reader = CheckpointReader(tiny_chat_dir)
    fmt = Int4Format(32)
    plan = quantize.plan_quantize(reader, cfg, fmt)
    weights = quantize.DenseWeights(reader, plan)
    cal = LayerCalibrator(cfg, torch.randint(3, 49000, (2, 40)), fmt, reader.get, weights, reader.__contains__)
    seen: dict[str, torch.Tensor] = {}
    quantise = cal._quantise

    def record(x: torch.Tensor, modules, out, *args, **kw):  # noqa: ANN001, ANN202 (wraps _quantise)
        modules = list(modules)
        seen[modules[0].rsplit(".", 1)[1]] = x.clone()
        return quantise(x, modules, out, *args, **kw)

    cal._quantise = record
    for layer in range(2):
        out = cal.next_layer()
        a = f"model.layers.{layer}."
        deq = {m.rsplit(".", 1)[1]: fmt.dequantize(sw) for m, sw in out.items()}
        x = seen["q_proj"]
        attn_q = cal._gqa(f"{a}self_attn.", x, deq["q_proj"], deq["k_proj"], deq["v_proj"])
        attn_dense = cal._gqa(f"{a}self_attn.", x, *(weights(f"{a}self_attn.{n}_proj") for n in "qkv"))
        torch.testing.assert_close(seen["o_proj"], attn_q, rtol=0, atol=0)
        assert (seen["o_proj"] - attn_dense).abs().max() > 1e-3  # the dense outputs would be told apart
        x = seen["gate_proj"].reshape(-1, cfg.hidden_size)
        inner_q = F.silu(x @ deq["gate_proj"].t()) * (x @ deq["up_proj"].t())
        inner_dense = F.silu(x @ weights(f"{a}mlp.gate_proj").t()) * (x @ weights(f"{a}mlp.up_proj").t())
        torch.testing.assert_close(seen["down_proj"], inner_q, rtol=0, atol=0)
        assert (seen["down_proj"] - inner_dense).abs().max() > 1e-3
