"""`edgeserve quantize` from an FP8 block-scaled MoE checkpoint (the public MoE checkpoints' format) to
INT4: every expert goes through its FP8 value (e4m3 times its 128 x 128 block's scale, partial edge blocks
included), the router and the MTP layer are left as stored, and the pack-quantized output loads and
computes what its dequantised weights compute in transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from backend.compressed_tensors import PackQuantizedWriter
from backend.config import load_config
from backend.weight_formats import Fp8Format, Int4Format, weight_format
from backend.weights import CheckpointReader
from ops.quantize import quantize_checkpoint
from ops.quantize_ignore import DEFAULT_IGNORE
from tests.backend.test_compressed_tensors import _logits
from tests.backend.tiny_models import reference_model, write_tiny_glm4_moe

EXPERT = "model.layers.2.mlp.experts.5"


@pytest.fixture(scope="module")
def fp8_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Glm4Moe (experts 160 x 64: two row blocks, the second partial) with an MTP layer, in BF16,
    converted to FP8 with 128 x 128 block scales."""
    root = tmp_path_factory.mktemp("fp8moe")
    src = write_tiny_glm4_moe(root / "f32", seed=5, mtp_layers=1, moe_intermediate_size=160)
    tensors = {n: t if n.endswith("e_score_correction_bias") else t.bfloat16()
               for n, t in load_file(src / "model.safetensors").items()}
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    quantize_checkpoint(src, root / "fp8", weight_format("fp8"), progress=False)
    return root / "fp8"


def _blockwise(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 values times their block's scale, one 128 x 128 block at a time."""
    out = torch.empty(q.shape)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(128 * i, 128 * (i + 1)), slice(128 * j, 128 * (j + 1))
            out[rows, cols] = q[rows, cols].float() * scale[i, j]
    return out


@pytest.mark.parametrize("target", [Int4Format(32), PackQuantizedWriter(32, DEFAULT_IGNORE)], ids=repr)
def test_experts_go_through_their_fp8_value_and_the_router_is_left_alone(fp8_moe: Path, tmp_path: Path,
                                                                         target: Int4Format) -> None:
    out = tmp_path / "int4"
    quantize_checkpoint(fp8_moe, out, target, progress=False)
    src, dst = CheckpointReader(fp8_moe), CheckpointReader(out)
    for proj, blocks in (("gate_proj", (2, 1)), ("down_proj", (1, 2))):
        module = f"{EXPERT}.{proj}"
        q, scale = src.get(f"{module}.weight"), src.get(f"{module}.weight_scale_inv")
        assert q.dtype == torch.float8_e4m3fn and tuple(scale.shape) == blocks
        w = _blockwise(q, scale)
        assert torch.equal(Fp8Format().dequantize(Fp8Format().read(src.get, module)), w)
        expected = target.quantize(w)
        assert all(torch.equal(dst.get(f"{module}.{s}"), t) for s, t in expected.tensors.items()), module
        assert f"{module}.weight" not in set(dst.names())
    cfg = load_config(out)
    kept = [n for n in src.names() if ".mlp.gate." in n or n.startswith(f"model.layers.{cfg.num_layers}.")
            or "norm" in n or "embed" in n or n == "lm_head.weight"]
    assert any(".mlp.gate.e_score_correction_bias" in n for n in kept)
    assert any(n.startswith(f"model.layers.{cfg.num_layers}.mlp.experts.") for n in kept)  # MTP: copied
    for name in kept:
        a, b = src.get(name), dst.get(name)
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    assert src.get("model.layers.1.mlp.gate.e_score_correction_bias").dtype == torch.float32


def test_pack_quantized_output_computes_its_dequantised_weights(fp8_moe: Path, tmp_path: Path) -> None:
    """The FP8 -> pack-quantized checkpoint in our engine (float32 weights: codes x scales exactly) gives
    the logits transformers gives on its weights dequantised, the MTP layer left out."""
    out = tmp_path / "ct"
    quantize_checkpoint(fp8_moe, out, PackQuantizedWriter(32, DEFAULT_IGNORE), progress=False)
    cfg = load_config(out)
    fmt = PackQuantizedWriter(32)
    reader = CheckpointReader(out)
    dense = {}
    for name in reader.names():
        if name.startswith(f"model.layers.{cfg.num_layers}."):
            continue
        module, suffix = name.rsplit(".", 1)
        if suffix == "weight_packed":
            dense[f"{module}.weight"] = fmt.dequantize(fmt.read(reader.get, module))
        elif suffix not in ("weight_scale", "weight_shape"):
            dense[name] = reader.get(name).float()
    ref_dir = tmp_path / "dense"
    ref_dir.mkdir()
    save_file(dense, ref_dir / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((out / "config.json").read_text())
    del raw["quantization_config"]
    (ref_dir / "config.json").write_text(json.dumps(raw))
    ids = torch.randint(0, 320, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        expected = reference_model(ref_dir)(torch.tensor([ids])).logits[0]
    assert expected.abs().max().item() > 0.3
    got = _logits(out, ids, prefill_weights="fp32", decode_weights="fp32")
    assert (got - expected).abs().max().item() <= 1e-4
