"""The compressed-tensors pack-quantized writer against the `compressed-tensors` package itself: our
symmetric grid and packing are the package's bit for bit; a tiny Glm4Moe checkpoint written by the writer
is read by the package (per module, and through transformers' loader) with the weights we dequantise, and
our own loader computes the logits transformers computes on the package's decompression."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from backend.compressed_tensors import (PackQuantizedWriter, pack_quantized_tensors, quantization_config,
                                        symmetric_int4)
from backend.config import load_config
from backend.errors import WeightsError
from backend.model import load_model
from backend.models.checkpoint_layout import checkpoint_layout
from backend.weight_formats import Int4Format, TensorSpec
from ops.quantize_ignore import DEFAULT_IGNORE, KIMI_IGNORE, is_ignored
from tests.backend.test_compressed_tensors import _logits
from tests.backend.tiny_models import reference_model, write_tiny_glm4_moe

pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor  # noqa: E402
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402
from compressed_tensors.utils.match import match_name  # noqa: E402


def _args(group: int) -> QuantizationArgs:
    return QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group)


def _weights(dtype: torch.dtype, n: int = 48, k: int = 256) -> torch.Tensor:
    """Random weights with the cases that matter: a group of zeros, a one-signed group, a big outlier."""
    w = torch.randn(n, k) * (torch.rand(n, 1) * 0.1 + 0.01)
    w[3, :32] = 0
    w[5, 32:64] = w[5, 32:64].abs()
    w[7, 70] = 1.5
    return w.to(dtype)


def _codes(sw) -> torch.Tensor:
    q = sw.tensors["qweight"]
    return (torch.stack([q & 0xF, q >> 4], dim=-1).reshape(q.shape[0], -1).to(torch.int8) - 8)


@pytest.mark.parametrize("group", [32, 128])
def test_bf16_weights_get_the_packages_scales_and_codes_bit_for_bit(group: int) -> None:
    w = _weights(torch.bfloat16)
    sw = symmetric_int4(w, group)
    g = w.reshape(w.shape[0], -1, group)
    scale, _ = calculate_qparams(g.amin(-1), g.amax(-1), _args(group))  # the package's observer maths
    assert scale.dtype == torch.bfloat16 and torch.equal(sw.tensors["scales"], scale)
    q = ct_quantize(w, scale, torch.zeros_like(scale), _args(group), dtype=torch.int8)
    assert torch.equal(_codes(sw), q) and not sw.tensors["zeros"].any()
    assert (q == -8).any() and (q == 7).any()  # all 16 levels in use, 7.5 steps each side
    assert torch.equal(pack_quantized_tensors("m", sw)["m.weight_packed"], pack_to_int32(q, 4))


def test_fp32_weights_are_coded_against_the_bf16_scale_they_are_stored_with() -> None:
    w = _weights(torch.float32)
    sw = symmetric_int4(w, 32)
    scale = sw.tensors["scales"]
    amax = w.abs().reshape(48, -1, 32).amax(-1)
    assert torch.equal(scale, torch.where(amax == 0, torch.tensor(2.0 ** -7), amax / 7.5).bfloat16())
    q = ct_quantize(w, scale.float(), torch.zeros_like(scale, dtype=torch.float32), _args(32), dtype=torch.int8)
    assert torch.equal(_codes(sw), q)
    err = (Int4Format(32).dequantize(sw) - w).abs()
    step = scale.float().repeat_interleave(32, dim=1)
    # round to nearest; the positive end sits half a step short, plus the bf16 rounding of the scale
    # (amax / scale <= 7.5 * (1 + 2**-8))
    assert (err <= (0.5 + 7.5 * 2 ** -8) * step).all() and (err > 0.45 * step).any()


def test_packed_tensors_unpack_to_the_same_codes_and_back() -> None:
    sw = symmetric_int4(_weights(torch.float32, 40, 96), 32)
    out = pack_quantized_tensors("layer.m", sw)
    assert {k: (v.dtype, tuple(v.shape)) for k, v in out.items()} == {
        "layer.m.weight_packed": (torch.int32, (40, 12)), "layer.m.weight_scale": (torch.bfloat16, (40, 3)),
        "layer.m.weight_shape": (torch.int64, (2,))}
    assert out["layer.m.weight_shape"].tolist() == [40, 96]
    assert torch.equal(unpack_from_int32(out["layer.m.weight_packed"], 4, torch.Size([40, 96])), _codes(sw))
    fmt = PackQuantizedWriter(32)
    back = fmt.unpack(fmt.pack(sw, "layer.m"), "layer.m")
    assert all(torch.equal(back.tensors[s], sw.tensors[s]) for s in ("qweight", "scales", "zeros"))
    assert fmt.specs((40, 96)) == {k.rsplit(".", 1)[1]: TensorSpec(v.dtype, tuple(v.shape)) for k, v in out.items()}


def test_bad_input_is_a_weights_error() -> None:
    with pytest.raises(WeightsError, match=r"asymmetric"):
        pack_quantized_tensors("m", Int4Format(32).quantize(torch.randn(8, 64)))  # our zero-point grid
    with pytest.raises(WeightsError, match=r"m: a pack-quantized weight needs in_features divisible by .* 32"):
        symmetric_int4(torch.randn(8, 48), 32, "m")
    with pytest.raises(WeightsError, match=r"group size 48"):
        symmetric_int4(torch.randn(8, 96), 48)
    with pytest.raises(WeightsError, match=r"group size 48"):
        PackQuantizedWriter(48)
    with pytest.raises(WeightsError, match=r"divisible"):
        PackQuantizedWriter(128).specs((8, 64))
    with pytest.raises(WeightsError, match=r"actorder 'group'"):
        quantization_config(32, [], actorder="group")


def write_pack_quantized(src: Path, dst: Path, group: int, ignore: tuple[str, ...]) -> Path:
    """`src` rewritten by the writer: every linear of the layout and the LM head that `ignore` leaves
    is `symmetric_int4` + `pack_quantized_tensors`; everything else is copied; config.json gets
    `quantization_config(group, ignore)`."""
    cfg = load_config(src)
    linears = {*checkpoint_layout(cfg).linears, "lm_head"}
    out = {}
    for name, t in load_file(src / "model.safetensors").items():
        module = name.removesuffix(".weight")
        if module in linears and name.endswith(".weight") and not is_ignored(module, ignore):
            out.update(pack_quantized_tensors(module, symmetric_int4(t, group, module)))
        else:
            out[name] = t
    dst.mkdir(parents=True)
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((src / "config.json").read_text())
    raw["quantization_config"] = quantization_config(group, ignore)
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


def _package_dense(ct: Path, dst: Path) -> Path:
    """The package's own decompression of every packed module of `ct` (float32 scales: exact), as a
    dense checkpoint for transformers. Which modules are packed is asked of the package's matcher."""
    qc = QuantizationConfig.model_validate(json.loads((ct / "config.json").read_text())["quantization_config"])
    scheme = qc.config_groups["group_0"]
    tensors = load_file(ct / "model.safetensors")
    dense = {}
    for name, t in tensors.items():
        if name.endswith(".weight_packed"):
            m = name.removesuffix(".weight_packed")
            assert not any(match_name(m, p) for p in qc.ignore), m
            sd = {s: tensors[f"{m}.{s}"] for s in ("weight_packed", "weight_scale", "weight_shape")}
            dense[f"{m}.weight"] = PackedQuantizationCompressor.decompress(
                {**sd, "weight_scale": sd["weight_scale"].float()}, scheme)["weight"]
        elif not name.endswith((".weight_scale", ".weight_shape")):
            dense[name] = t
    dst.mkdir()
    save_file(dense, dst / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((ct / "config.json").read_text())
    del raw["quantization_config"]
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_glm4_moe(tmp_path_factory.mktemp("src") / "m", seed=21)


@pytest.mark.parametrize("ignore, packed", [(KIMI_IGNORE, 2 * 8 * 3), (DEFAULT_IGNORE, 3 * 4 + 3 + 2 * (8 + 1) * 3)])
def test_the_package_reads_what_the_writer_wrote(tiny: Path, tmp_path: Path, ignore: tuple[str, ...],
                                                 packed: int) -> None:
    """Per module, the package's decompression equals our dequantisation exactly (float32 scales) and in
    bfloat16; transformers' compressed-tensors loader holds the same weights."""
    import transformers

    ct = write_pack_quantized(tiny, tmp_path / "ct", 32, ignore)
    qc = QuantizationConfig.model_validate(json.loads((ct / "config.json").read_text())["quantization_config"])
    assert qc.format == "pack-quantized" and qc.config_groups["group_0"].weights == _args(32)
    tensors = load_file(ct / "model.safetensors")
    modules = sorted(n.removesuffix(".weight_packed") for n in tensors if n.endswith(".weight_packed"))
    assert len(modules) == packed
    fmt = PackQuantizedWriter(32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(ct, dtype=torch.float32)
    hf(torch.tensor([[1]]))  # the package decompresses the linears on the first forward
    params = dict(hf.named_parameters())
    inter = load_config(ct).moe_intermediate_size
    for m in modules:
        ours = fmt.dequantize(fmt.read(tensors.__getitem__, m))
        sd = {s: tensors[f"{m}.{s}"] for s in ("weight_packed", "weight_scale", "weight_shape")}
        scheme = qc.config_groups["group_0"]
        assert torch.equal(ours, PackedQuantizationCompressor.decompress(
            {**sd, "weight_scale": sd["weight_scale"].float()}, scheme)["weight"])
        assert torch.equal(ours.bfloat16(), PackedQuantizationCompressor.decompress(sd, scheme)["weight"])
        head, sep, tail = m.partition(".mlp.experts.")
        if sep:  # transformers fuses the experts ([E, 2I, H] gate rows first, [E, H, I]) from the package's bf16
            j, proj = tail.split(".")
            fused = params[f"{head}.mlp.experts.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"][int(j)]
            part = fused if proj == "down_proj" else fused[(proj == "up_proj") * inter:][:inter]
            assert torch.equal(part, ours.to(part.dtype)), m
        else:
            assert torch.equal(hf.get_submodule(m).weight, ours), m


@pytest.mark.parametrize("ignore", [KIMI_IGNORE, DEFAULT_IGNORE])
def test_our_loader_gives_the_logits_of_the_packages_decompression(tiny: Path, tmp_path: Path,
                                                                   ignore: tuple[str, ...]) -> None:
    ct = write_pack_quantized(tiny, tmp_path / "ct", 32, ignore)
    ref = reference_model(_package_dense(ct, tmp_path / "dense"))
    ids = torch.randint(0, 320, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    assert expected.abs().max().item() > 0.3
    model = load_model(ct)
    assert type(model.formats["decode"]).__name__ == "CompressedTensorsInt4"
    exact = _logits(ct, ids, prefill_weights="fp32", decode_weights="fp32")  # codes x scales, float32
    assert (exact - expected).abs().max().item() <= 1e-4
    int4 = _logits(ct, ids)  # the INT4 GEMM on bfloat16 activations
    rows = (int4 - expected).abs().amax(dim=-1)  # per position
    if ignore == KIMI_IGNORE:  # only the experts run INT4 (measured 2.9e-3)
        assert rows.max().item() < 1e-2, rows
    else:  # attention too: bf16 activations can flip a near-tied routing choice for a token (an error of
        # ~0.3 on that row); every other row stays within the INT4 GEMM's rounding
        assert (rows < 1e-2).float().mean().item() >= 0.9, rows

def test_quantize_checkpoint_writes_the_same_checkpoint_with_the_writer_as_target(tiny: Path,
                                                                                 tmp_path: Path) -> None:
    """`edgeserve quantize` with `PackQuantizedWriter` as its target: on Glm4Moe the default list
    ignores none of the layout's linears, so the output is `write_pack_quantized`'s tensor for tensor."""
    from ops.quantize import quantize_checkpoint

    quantize_checkpoint(tiny, tmp_path / "q", PackQuantizedWriter(32, DEFAULT_IGNORE), progress=False)
    ours = load_file(write_pack_quantized(tiny, tmp_path / "w", 32, DEFAULT_IGNORE) / "model.safetensors")
    got = load_file(tmp_path / "q" / "model.safetensors")
    assert got.keys() == ours.keys() and all(torch.equal(got[k], ours[k]) for k in ours)
    assert json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"] == \
        quantization_config(32, DEFAULT_IGNORE)
