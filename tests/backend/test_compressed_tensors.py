"""compressed-tensors pack-quantized INT4 (Kimi K2-Thinking/K2.5/K2.6's format) against checkpoints written
by the `compressed-tensors` package itself: a tiny Glm4MoeForCausalLM whose routed experts the package
quantises (group 32, symmetric) and packs, with Kimi's ignore list leaving attention, the shared experts and
the dense layer dense. Our unpacked codes and scales equal the package's bit for bit, the logits equal
transformers' on the package's decompressed weights, and bad input is a WeightsError naming the tensor."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from backend.compressed_tensors import CompressedTensorsInt4, compressed_tensors_format, int4_from_pack_quantized
from backend.config import load_config
from backend.errors import WeightsError
from backend.layers.loader import WeightLoader
from backend.linear import Int4Linear, Linear
from backend.model import load_model
from backend.weight_formats import Int4Format
from tests.backend.test_checkpoint_prefix import wrap
from tests.backend.test_model_parity import _our_logits_all_rows
from tests.backend.tiny_models import reference_model, write_tiny_glm4_moe

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor  # noqa: E402
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32  # noqa: E402
from compressed_tensors.quantization import (  # noqa: E402
    QuantizationArgs, QuantizationConfig, QuantizationScheme, apply_quantization_config)
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402

KIMI_IGNORE = ["lm_head", r"re:.*self_attn.*", r"re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]
W4_G32 = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
SCHEME = QuantizationScheme(targets=["Linear"], weights=W4_G32)


def _shell(weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """nn.Linear modules named as the checkpoint's linears (`<m>` for `<m>.weight`), holding its weights."""
    root = torch.nn.Module()
    for name, w in weights.items():
        *path, leaf = name.split(".")
        parent = root
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
        lin.weight.data.copy_(w)
        parent.add_module(leaf, lin)
    return root


def compress_checkpoint(path: Path, ignore: list[str] | None = None) -> Path:
    """Rewrite the float checkpoint at `path`: compressed-tensors quantises its linears (every
    `*_proj`, `*_proj_with_mqa` and `lm_head` weight; W4A16, group 32, bf16 scales as Kimi ships them) and
    packs them, except those `ignore` (Kimi's list by default) names; config.json gets the package's
    quantization_config with that ignore list. Beside it, `path.parent / "dense"` holds the same model with
    the package's own decompression of every packed weight (float32: exact), for transformers."""
    ignore = KIMI_IGNORE if ignore is None else ignore
    file = next(path.glob("*.safetensors"))
    tensors = load_file(file)
    linears = [k[: -len(".weight")] for k, v in tensors.items() if v.dim() == 2 and
               (k.endswith(("_proj.weight", "_proj_with_mqa.weight")) or k == "lm_head.weight")]
    root = _shell({m: tensors[f"{m}.weight"].bfloat16() for m in linears})  # the experts as Kimi's BF16
    apply_quantization_config(root, QuantizationConfig(config_groups={"group_0": SCHEME}, ignore=ignore))
    for _, module in root.named_modules():
        if hasattr(module, "weight_scale"):  # the static weight observer's job: min/max per group of 32
            w = module.weight.float().reshape(module.weight.shape[0], -1, 32)
            scale, _ = calculate_qparams(w.amin(-1), w.amax(-1), W4_G32)
            module.weight_scale.data.copy_(scale)
    compressor = ModelCompressor.from_pretrained_model(root, "pack-quantized")
    compressor.compress_model(root)
    packed = {k: v for k, v in root.state_dict().items() if not k.endswith(".weight")}
    modules = {k.rsplit(".", 1)[0] for k in packed}
    dense = dict(tensors)
    for m in modules:
        tensors.pop(f"{m}.weight")
        sd = {s: packed[f"{m}.{s}"] for s in ("weight_packed", "weight_scale", "weight_shape")}
        dense[f"{m}.weight"] = PackedQuantizationCompressor.decompress(
            {**sd, "weight_scale": sd["weight_scale"].float()}, SCHEME)["weight"]
    tensors.update(packed)
    save_file(tensors, file, metadata={"format": "pt"})
    ref = path.parent / "dense"
    ref.mkdir(exist_ok=True)
    (ref / "config.json").write_text((path / "config.json").read_text())
    save_file(dense, ref / "model.safetensors", metadata={"format": "pt"})
    compressor.update_config(str(path))
    raw = json.loads((path / "config.json").read_text())
    raw["quantization_config"]["ignore"] = ignore  # the package writes the names it matched; Kimi ships the list
    (path / "config.json").write_text(json.dumps(raw))
    return path


def write_ct_glm4_moe(path: Path, seed: int = 0, ignore: list[str] | None = None) -> Path:
    """A tiny random Glm4Moe at `path`, compressed by `compress_checkpoint`."""
    return compress_checkpoint(write_tiny_glm4_moe(path, seed=seed), ignore)


@pytest.fixture(scope="module")
def ct_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_ct_glm4_moe(tmp_path_factory.mktemp("ct") / "m", seed=11)


def _packed_modules(path: Path) -> list[str]:
    return sorted(k[: -len(".weight_packed")] for k in load_file(next(path.glob("*.safetensors")))
                  if k.endswith(".weight_packed"))


def test_only_the_routed_experts_are_packed_under_kimis_ignore_list(ct_dir: Path) -> None:
    mods = _packed_modules(ct_dir)
    assert len(mods) == 2 * 8 * 3 and all(".mlp.experts." in m for m in mods)  # 2 MoE layers, 8 experts, 3
    qc = json.loads((ct_dir / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"


def test_codes_and_scales_equal_the_packages_bit_for_bit(ct_dir: Path) -> None:
    """Per packed module: our INT4 codes minus 8 are the package's unpacked int8 values, our scales its
    weight_scale bits, and our dequantised weight its decompression (exact in float32; in bfloat16, the
    package's own bfloat16 output)."""
    loader = WeightLoader(ct_dir, load_config(ct_dir), torch.float32)
    assert isinstance(loader.stored, CompressedTensorsInt4) and loader.stored.group_size == 32
    raw = load_file(next(ct_dir.glob("*.safetensors")))
    for m in _packed_modules(ct_dir):
        src, sw = loader.read(m)
        packed, scale, shape = (raw[f"{m}.{s}"] for s in ("weight_packed", "weight_scale", "weight_shape"))
        q = sw.tensors["qweight"]
        codes = torch.stack([q & 0xF, q >> 4], dim=-1).reshape(q.shape[0], -1).to(torch.int8) - 8
        assert torch.equal(codes, unpack_from_int32(packed, 4, torch.Size(shape.tolist())))
        assert sw.tensors["scales"].dtype == torch.bfloat16 and torch.equal(sw.tensors["scales"].view(torch.int16),
                                                                            scale.view(torch.int16))
        assert not sw.tensors["zeros"].any()
        ours = src.dequantize(sw)
        sd = {"weight_packed": packed, "weight_scale": scale, "weight_shape": shape}
        assert torch.equal(ours, PackedQuantizationCompressor.decompress(
            {**sd, "weight_scale": scale.float()}, SCHEME)["weight"])
        assert torch.equal(ours.bfloat16(), PackedQuantizationCompressor.decompress(sd, SCHEME)["weight"])


def test_logits_match_transformers_on_the_packages_decompressed_weights(ct_dir: Path) -> None:
    """As stored: routed experts INT4 g32 (the CPU INT4 GEMM, bfloat16 activations), everything the
    ignore list names dense float32. With fp32 prefill weights the INT4 codes are dequantised exactly."""
    ref = reference_model(ct_dir.parent / "dense")
    ids = torch.randint(0, 320, (40,)).tolist()
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    model = load_model(ct_dir)
    layer = model.phase_layers["decode"][1]
    c_call = layer.moe.experts.int4 is not None  # the grouped C call of INT4 experts (kernels/cpu_moe_experts.py)
    assert type(layer.moe.experts.fmt) is CompressedTensorsInt4
    assert layer.moe.experts.paths == (("grouped", "loop") if c_call else ("loop",))
    assert isinstance(layer.moe.experts.ops[0][0], Int4Linear) and c_call == layer.moe.experts.ops[0][0].gemv
    assert type(layer.moe.shared_gate_up) is Linear and layer.moe.shared_gate_up.weight.dtype == torch.float32
    assert type(layer.qkv) is Linear and type(model.phase_layers["decode"][0].gate_up) is Linear

    assert expected.abs().max().item() > 0.3
    int4_diff = (_logits(ct_dir, ids) - expected).abs().max().item()
    assert int4_diff < 1e-2, int4_diff  # bfloat16 activations into the INT4 GEMM (measured 2.8e-3)
    exact = _logits(ct_dir, ids, prefill_weights="fp32", decode_weights="fp32")
    assert (exact - expected).abs().max().item() <= 1e-4


def test_a_repacked_weight_runs_in_the_int4_gemm_as_its_codes_times_scales() -> None:
    """Random codes packed by the package: the INT4 GEMM on the repacked bits computes x @ (q * s).T."""
    n, k = 48, 96
    q = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    scale = (torch.rand(n, k // 32) * 0.05 + 0.01).bfloat16()
    sw = int4_from_pack_quantized(pack_to_int32(q, 4), scale, torch.tensor([n, k]), 32, "m")
    w = q.float() * scale.float().repeat_interleave(32, dim=1)
    assert torch.equal(Int4Format(32).dequantize(sw), w)
    x = torch.randn(5, k)
    got = Int4Format(32).linear(sw, None, torch.float32)(x)
    want = x.bfloat16().float() @ w.t()
    assert (got.float() - want).abs().max().item() <= 2e-2 * want.abs().max().item()


def test_bad_packed_tensors_are_weights_errors_naming_the_tensor() -> None:
    q = torch.randint(-8, 8, (4, 64), dtype=torch.int8)
    packed, scale = pack_to_int32(q, 4), torch.rand(4, 2).bfloat16()
    with pytest.raises(WeightsError, match=r"m\.weight_shape.*\[4, 72\]"):
        int4_from_pack_quantized(packed, scale, torch.tensor([4, 72]), 32, "m")  # 72 packs into 9 words, not 8
    with pytest.raises(WeightsError, match=r"m\.weight_shape.*\[5, 64\]"):
        int4_from_pack_quantized(packed, scale, torch.tensor([5, 64]), 32, "m")
    with pytest.raises(WeightsError, match=r"m: in_features 48 is not a multiple of the group size 32"):
        int4_from_pack_quantized(pack_to_int32(q[:, :48].contiguous(), 4), scale, torch.tensor([4, 48]), 32, "m")
    with pytest.raises(WeightsError, match=r"m\.weight_scale"):
        int4_from_pack_quantized(packed, scale[:, :1], torch.tensor([4, 64]), 32, "m")
    with pytest.raises(WeightsError, match=r"m\.weight_packed must be 2-D int32"):
        int4_from_pack_quantized(packed.view(torch.float32), scale, torch.tensor([4, 64]), 32, "m")


def _group(**weights: object) -> dict[str, object]:
    return {"targets": ["Linear"], "weights": {**W4_G32.model_dump(), **weights}, "input_activations": None}


@pytest.mark.parametrize("qc, match", [
    ({"format": "float-quantized", "config_groups": {"g": _group()}}, "format 'float-quantized'"),
    ({"format": "nvfp4-pack-quantized", "config_groups": {"g": _group()}}, "nvfp4"),
    ({"format": "pack-quantized", "config_groups": {"a": _group(), "b": _group(symmetric=False)}}, "one scheme"),
    ({"format": "pack-quantized", "config_groups": {"g": _group(num_bits=8)}}, "config group 'g'"),
    ({"format": "pack-quantized", "config_groups": {"g": _group(actorder="group")}}, "activation ordering"),
    ({"format": "pack-quantized", "config_groups": {"g": _group(group_size=48)}}, "group_size 48"),
    ({"format": "pack-quantized", "config_groups": {"a": _group(), "b": _group(group_size=64)}},
     r"\(32, True\), \(64, True\)"),
    ({"format": "pack-quantized", "config_groups": {}}, "config_groups"),
])
def test_unsupported_configs_are_weights_errors(qc: dict[str, object], match: str) -> None:
    with pytest.raises(WeightsError, match=match):
        compressed_tensors_format({"quant_method": "compressed-tensors", **qc})


def test_ignore_names_and_regexes_with_and_without_the_prefix() -> None:
    fmt = compressed_tensors_format({"quant_method": "compressed-tensors", "format": "pack-quantized",
                                     "config_groups": {"g": _group()}, "ignore": KIMI_IGNORE + [
                                         "language_model.model.layers.3.mlp.experts.0.up_proj"]},
                                    prefix="language_model.")
    assert fmt.quantizes("model.layers.1.mlp.experts.7.down_proj")
    for dense in ("model.layers.1.self_attn.kv_b_proj", "model.layers.0.mlp.gate_proj",
                  "model.layers.1.mlp.shared_experts.up_proj", "lm_head", "model.layers.3.mlp.experts.0.up_proj"):
        assert not fmt.quantizes(dense), dense
    targeted = compressed_tensors_format({"quant_method": "compressed-tensors", "format": "pack-quantized",
                                          "config_groups": {"g": {**_group(), "targets": [r"re:.*experts\.\d+\..*"]}}})
    assert targeted.quantizes("model.layers.1.mlp.experts.0.gate_proj")
    assert not targeted.quantizes("model.layers.1.mlp.shared_experts.gate_proj")


def test_a_packed_module_the_config_ignores_is_a_weights_error(tmp_path: Path) -> None:
    path = write_ct_glm4_moe(tmp_path / "m", seed=12)
    raw = json.loads((path / "config.json").read_text())
    raw["quantization_config"]["ignore"] += ["model.layers.2.mlp.experts.5.down_proj"]
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(WeightsError, match=r"model\.layers\.2\.mlp\.experts\.5\.down_proj\.weight_packed"):
        load_model(path)


def test_a_disagreeing_weight_shape_in_a_checkpoint_names_the_tensor(tmp_path: Path) -> None:
    path = write_ct_glm4_moe(tmp_path / "m", seed=13)
    file = next(path.glob("*.safetensors"))
    tensors = load_file(file)
    tensors["model.layers.1.mlp.experts.3.gate_proj.weight_shape"] = torch.tensor([32, 72])
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(WeightsError, match=r"model\.layers\.1\.mlp\.experts\.3\.gate_proj\.weight_shape"):
        load_model(path)


def _logits(path: Path, ids: list[int], **kw: object) -> torch.Tensor:
    from backend.engine import EngineConfig, LLMEngine

    cfg = EngineConfig(dtype="float32", kv_format="fp32", kv_cache_bytes=4 * 2**20, page_size=16, gemm_buckets=(),
                       **kw)
    return _our_logits_all_rows(LLMEngine.from_pretrained(path, cfg), ids)


def test_kimi_wrapped_checkpoint_loads_as_the_plain_one(ct_dir: Path, tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """Kimi K2.5/K2.6's layout: the text model under `language_model.`, quantization_config inside
    text_config, a vision tower beside it (skipped with one log line): the same logits as the plain folder."""
    wrapped = wrap(ct_dir, tmp_path / "kimi")
    assert "quantization_config" not in json.loads((wrapped / "config.json").read_text())
    ids = torch.randint(0, 320, (20,)).tolist()
    with caplog.at_level(logging.INFO, logger="backend.weights"):
        got = _logits(wrapped, ids)
    assert [r.getMessage() for r in caplog.records if r.name == "backend.weights"] == [
        "skipping 3 checkpoint tensors outside 'language_model.' (not the text model): mm_projector.*, vision_tower.*"]
    torch.testing.assert_close(got, _logits(ct_dir, ids), rtol=0, atol=0)


def test_kimi_int4_deepseek_v3_matches_transformers_on_the_decompressed_weights(tmp_path: Path) -> None:
    """The whole Kimi K2.5/K2.6 shape on a tiny DeepseekV3: routed experts packed by compressed-tensors,
    MLA, shared experts and the dense layer left dense by Kimi's ignore list, all under
    `language_model.` with the quantization_config in text_config."""
    from tests.backend.tiny_mla_models import write_tiny_deepseek_v3

    plain = compress_checkpoint(write_tiny_deepseek_v3(tmp_path / "m", seed=14))
    assert all(".mlp.experts." in m for m in _packed_modules(plain)) and len(_packed_modules(plain)) == 2 * 8 * 3
    wrapped = wrap(plain, tmp_path / "kimi")
    ref = reference_model(tmp_path / "dense")
    ids = torch.randint(0, 320, (40,)).tolist()
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    assert expected.abs().max().item() > 0.3
    int4_diff = (_logits(wrapped, ids) - expected).abs().max().item()
    assert int4_diff < 1e-2, int4_diff  # bfloat16 activations into the INT4 GEMM (measured 2.0e-3)
    exact = _logits(wrapped, ids, prefill_weights="fp32", decode_weights="fp32")
    assert (exact - expected).abs().max().item() <= 1e-4


@pytest.mark.cuda
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available(),
                    reason="needs a CUDA device and TRITON_INTERPRET=0")
def test_cuda_runs_the_repacked_experts_in_the_fused_int4_kernel(ct_dir: Path) -> None:
    cpu = load_model(ct_dir).phase_layers["decode"][1].moe
    gpu = load_model(ct_dir, device="cuda").phase_layers["decode"][1].moe
    assert gpu.experts.paths == ("fused",) and gpu.experts.fused_args["fmt"] == "int4"
    x = torch.randn(37, 64)
    torch.testing.assert_close(gpu(x.cuda()).cpu(), cpu(x), rtol=3e-2, atol=3e-2)
