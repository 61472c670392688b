"""DeepSeek-V3 / Kimi-K2-Instruct / GLM-5-FP8 block-scaled FP8 weights through the loader: `read` +
`dequantize` (what the MLA model does to kv_b_proj at load) equal a direct dequantisation on fresh random
weights, with partial 128 x 128 edge blocks, under the Kimi prefix too; `scale_fmt: ue8m0` scales stored as
float32 or F8_E8M0; modules the checkpoint leaves dense stay dense."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from backend.config import load_config
from backend.errors import WeightsError
from backend.layers.loader import WeightLoader
from backend.linear import Linear
from backend.weight_formats import DenseFormat, Fp8Format, Int4Format, stored_format

KV_B = "model.layers.0.self_attn.kv_b_proj"  # [H * (nope + v), R]: 4 heads * (48 + 32) x 200, partial blocks
TEXT = dict(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=32, intermediate_size=64,
            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)


def _fp8_weight(n: int, k: int, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Random e4m3 codes [n, k] and random float32 scales, one per block (never 1)."""
    q = (torch.randn(n, k) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-n // block), -(-k // block)) * 0.01 + 1e-3
    return q, scale


def _direct(q: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    """W[i, j] = q[i, j] * scale[i // block, j // block], indexed element by element's block."""
    rows = torch.arange(q.shape[0]) // block
    cols = torch.arange(q.shape[1]) // block
    return q.float() * scale[rows[:, None], cols[None, :]]


def _folder(path: Path, tensors: dict[str, torch.Tensor], qc: dict[str, object], prefix: str = "") -> Path:
    path.mkdir(parents=True)
    text = {**TEXT, "quantization_config": qc}
    raw = {"architectures": TEXT["architectures"], "text_config": text} if prefix else text
    (path / "config.json").write_text(json.dumps(raw))
    save_file({prefix + k: v for k, v in tensors.items()}, path / "model.safetensors", metadata={"format": "pt"})
    return path


QC = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


@pytest.mark.parametrize("prefix", ["", "language_model."])
def test_read_and_dequantize_kv_b_proj_equals_the_direct_dequantisation(tmp_path: Path, prefix: str) -> None:
    q, scale = _fp8_weight(320, 200)
    gate = torch.randn(8, 32).bfloat16()  # the MoE router: never quantised, read through get
    path = _folder(tmp_path / "m", {f"{KV_B}.weight": q, f"{KV_B}.weight_scale_inv": scale,
                                    "model.layers.0.mlp.gate.weight": gate}, QC, prefix)
    loader = WeightLoader(path, load_config(path), torch.float32)
    src, sw = loader.read(KV_B, (320, 200))
    assert isinstance(src, Fp8Format) and sw.tensors["weight_scale_inv"].shape == (3, 2)
    want = _direct(q, scale)
    assert want.abs().max().item() > 1.0  # the scales matter
    assert torch.equal(src.dequantize(sw), want)
    assert torch.equal(loader.get("model.layers.0.mlp.gate.weight"), gate.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e8m0fnu])
def test_ue8m0_power_of_two_scales_in_float32_or_e8m0(tmp_path: Path, dtype: torch.dtype) -> None:
    q, _ = _fp8_weight(130, 300)
    scale = torch.exp2(torch.randint(-12, -2, (2, 3)).float())  # [ceil(130/128), ceil(300/128)]
    path = _folder(tmp_path / "m", {f"{KV_B}.weight": q, f"{KV_B}.weight_scale_inv": scale.to(dtype)},
                   {**QC, "scale_fmt": "ue8m0"})
    loader = WeightLoader(path, load_config(path), torch.float32)
    assert loader.stored.quantization_config()["scale_fmt"] == "ue8m0"
    src, sw = loader.read(KV_B)
    assert sw.tensors["weight_scale_inv"].dtype == torch.float32
    assert torch.equal(src.dequantize(sw), _direct(q, scale))


def test_ue8m0_quantisation_rounds_scales_up_to_powers_of_two() -> None:
    w = torch.randn(200, 300) * torch.rand(200, 1) * 4
    sw = Fp8Format(scale_fmt="ue8m0").quantize(w)
    scale = sw.tensors["weight_scale_inv"]
    mantissa, _ = torch.frexp(scale)
    assert torch.all(mantissa == 0.5)  # powers of two
    plain = Fp8Format().quantize(w).tensors["weight_scale_inv"]
    assert torch.all(scale >= plain) and torch.all(scale < 2 * plain)
    deq = Fp8Format(scale_fmt="ue8m0").dequantize(sw)
    s = scale.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
    assert torch.all((deq - w).abs() <= w.abs() * 2**-4 + s * 2**-9)


def test_unknown_scale_fmt_is_a_weights_error() -> None:
    with pytest.raises(WeightsError, match="scale_fmt 'ue4m3'"):
        stored_format({**QC, "scale_fmt": "ue4m3"})


def test_a_scale_of_the_wrong_shape_names_the_tensor(tmp_path: Path) -> None:
    q, scale = _fp8_weight(300, 200)
    path = _folder(tmp_path / "m", {f"{KV_B}.weight": q, f"{KV_B}.weight_scale_inv": scale[:2]}, QC)
    loader = WeightLoader(path, load_config(path), torch.float32)
    with pytest.raises(WeightsError, match=rf"{KV_B}\.weight_scale_inv has shape \(2, 2\).*\[3, 2\]"):
        loader.read(KV_B)


def test_a_module_the_checkpoint_left_dense_stays_dense_as_stored(tmp_path: Path) -> None:
    """GLM-5-FP8 keeps e.g. the indexer's weights_proj in BF16: as stored it stays a dense GEMM in the
    compute dtype (not FP8); a fused group with one dense part is dense as a whole, its FP8 part
    dequantised exactly; an int4 target converts every part."""
    q, scale = _fp8_weight(64, 32)
    dense = torch.randn(16, 32).bfloat16()
    names = {"model.layers.0.self_attn.indexer.weights_proj": dense, "model.layers.0.self_attn.q_proj": q}
    path = _folder(tmp_path / "m", {"model.layers.0.self_attn.indexer.weights_proj.weight": dense,
                                    "model.layers.0.self_attn.q_proj.weight": q,
                                    "model.layers.0.self_attn.q_proj.weight_scale_inv": scale}, QC)
    loader = WeightLoader(path, load_config(path), torch.float32, decode_weights="int4", group_size=32)
    src, _ = loader.read("model.layers.0.self_attn.indexer.weights_proj")
    assert isinstance(src, DenseFormat) and src.dtype == torch.bfloat16
    specs = [(m, tuple(t.shape), 0) for m, t in names.items()]
    ops = loader.linears(specs[:1])
    assert type(ops["fp8"]) is Linear and torch.equal(ops["fp8"].weight, dense.float())
    fused = loader.linears(specs)
    assert torch.equal(fused["fp8"].weight, torch.cat([dense.float(), _direct(q, scale)]))
    assert repr(Int4Format(32)) in fused and type(fused[repr(Int4Format(32))]) is not Linear
