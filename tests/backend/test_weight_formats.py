"""Weight formats: round trips, layout changes, the CPU GEMMs, model logits, per-phase dispatch.

Model-level checks compare a model loaded with quantised linear layers against the same
model whose checkpoint holds the dequantised weights (in the checkpoint's own layout,
before the RoPE reordering of q/k rows), loaded dense in float32. A q/k row permutation
applied inconsistently to quantised rows and their scales would move whole rows of q and
k and change the logits by O(1); the tolerance is far below that.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from backend.engine import EngineConfig, LLMEngine
from backend.errors import WeightsError
from backend.linear import Int4Linear, Linear
from backend.sampling_params import SamplingParams
from backend.weight_formats import (DenseFormat, Fp8Format, Int4Format, is_quantized_linear, stored_format,
                                    weight_format)
from tests.backend.tiny_models import write_tiny_model

FORMATS = [weight_format("fp32"), weight_format("bf16"), weight_format("fp8"), weight_format("int4", 32),
           weight_format("int4", 128)]


def scaled_weight(n: int, k: int) -> torch.Tensor:
    return torch.randn(n, k) * torch.exp2(torch.empty(n, 1).uniform_(-4, 4))


@pytest.mark.parametrize("fmt", FORMATS, ids=repr)
def test_specs_describe_what_quantize_makes(fmt) -> None:
    sw = fmt.quantize(scaled_weight(200, 260))
    specs = fmt.specs((200, 260))
    assert set(specs) == set(sw.tensors) and sw.shape == (200, 260)
    for suffix, t in sw.tensors.items():
        assert (t.dtype, tuple(t.shape)) == (specs[suffix].dtype, specs[suffix].shape)
    assert sw.nbytes == sum(s.nbytes for s in specs.values())


@pytest.mark.parametrize("fmt", FORMATS, ids=repr)
def test_row_permutation_and_concatenation_commute_with_dequantise(fmt) -> None:
    """What loading does to q/k/v (RoPE reorder, then fuse) is exact in every format."""
    a, b = fmt.quantize(scaled_weight(200, 96)), fmt.quantize(scaled_weight(72, 96))
    perm = torch.randperm(200)
    moved = fmt.permute_rows(a, perm)
    assert torch.equal(fmt.dequantize(moved), fmt.dequantize(a)[perm])
    fused = fmt.cat_rows([moved, b])
    assert fused.shape == (272, 96)
    assert torch.equal(fmt.dequantize(fused), torch.cat([fmt.dequantize(a)[perm], fmt.dequantize(b)]))


def test_dense_formats_keep_values() -> None:
    w = scaled_weight(16, 32)
    assert torch.equal(weight_format("fp32").dequantize(weight_format("fp32").quantize(w)), w)
    assert torch.equal(weight_format("bf16").dequantize(weight_format("bf16").quantize(w)), w.bfloat16().float())


def test_fp8_expands_block_scales_per_row_only_when_rows_move() -> None:
    fmt = Fp8Format()
    sw = fmt.quantize(scaled_weight(200, 96))
    assert sw.tensors["weight_scale_inv"].shape == (2, 1)
    assert fmt.rowwise(sw).tensors["weight_scale_inv"].shape == (200, 1)
    assert torch.equal(fmt.dequantize(fmt.rowwise(sw)), fmt.dequantize(sw))


@pytest.mark.parametrize("kernel", [True, False], ids=["c-kernel", "torch-op"])
@pytest.mark.parametrize("n,k,group,bias", [(40, 96, 128, False), (24, 100, 32, True), (960, 576, 128, True),
                                            (48, 1536, 128, False), (17, 36, 32, False)])
def test_int4_cpu_gemm_matches_the_dequantised_weight(n: int, k: int, group: int, bias: bool, kernel: bool,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Int4Linear on CPU, either GEMM: the C kernel (N in panels of 16, K padded to 8) or torch's INT4 op
    (N padded to 16, K in runtime groups or padded); 7 rows (x tiles of 4 + 3) and 70 (two row blocks)."""
    from kernels.cpu_gemv_int4 import available

    if kernel and not available():
        pytest.skip("the INT4 C kernel needs AVX512-BF16 or AVX2 with FMA")
    monkeypatch.setenv("EDGESERVE_INT4_GEMV", "1" if kernel else "0")
    fmt = Int4Format(group)
    sw = fmt.quantize(scaled_weight(n, k))
    b = torch.randn(n) if bias else None
    lin = fmt.linear(sw, b, torch.float32)
    assert isinstance(lin, Int4Linear) and (lin.panels is not None) == kernel == lin.gemv
    for rows in (7, 70):
        x = torch.randn(rows, k)
        expected = x.bfloat16().double() @ fmt.dequantize(sw).double().t()  # the GEMMs read bf16 activations
        got = lin(x)
        assert got.dtype == torch.float32 and got.shape == (rows, n)
        if b is not None:
            got = got - b
        tol = 2.0 ** -8 * expected.abs() + 2.0 ** -12 * (x.abs().double() @ fmt.dequantize(sw).abs().double().t())
        assert ((got - expected).abs() <= tol).all()
    if not kernel:
        assert (k % lin.run_group == 0) == (lin.k_padded == k)


def test_bf16_dense_linear_casts_float32_activations() -> None:
    w = scaled_weight(24, 40).bfloat16()
    lin = Linear(w, None)
    x = torch.randn(3, 40)
    y = lin(x)
    assert y.dtype == torch.float32
    assert torch.equal(y, (x.bfloat16() @ w.t()).float())


def test_format_names_and_configs() -> None:
    assert [repr(f) for f in FORMATS] == ["fp32", "bf16", "fp8", "int4(g32)", "int4(g128)"]
    for fmt in (Fp8Format(), Int4Format(32)):
        again = stored_format(fmt.quantization_config())
        assert repr(again) == repr(fmt)
    assert stored_format(None) is None
    with pytest.raises(WeightsError, match="unknown weight format"):
        weight_format("int8")
    with pytest.raises(WeightsError, match="unknown weight format.*gptq"):
        stored_format({"quant_method": "gptq", "bits": 4})
    with pytest.raises(WeightsError, match="group size 48"):
        Int4Format(48)
    with pytest.raises(WeightsError, match="even"):
        Int4Format(32).quantize(torch.randn(8, 33))
    assert is_quantized_linear("model.layers.3.mlp.down_proj.weight")
    assert not is_quantized_linear("model.layers.3.input_layernorm.weight")
    assert not is_quantized_linear("lm_head.weight")


# ---------------------------------------------------------------- the model

def _sharpen_attention(path: Path) -> Path:
    """Scale q/k projections x8: random init leaves q.k near 0 and attention near uniform, where
    scrambled q/k rows would hardly show; sharp attention makes them move the logits."""
    tensors = load_file(path / "model.safetensors")
    for name in tensors:
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            tensors[name] = tensors[name] * 8
    save_file(tensors, path / "model.safetensors")
    return path


def _dequantised_copy(src: Path, dst: Path, fmt) -> Path:
    """`src` with every linear weight replaced by fmt.dequantize(fmt.quantize(w)), float32, same layout."""
    dst.mkdir()
    tensors = {}
    for f in src.glob("*.safetensors"):
        tensors.update(load_file(f))
    for name, w in tensors.items():
        if is_quantized_linear(name):
            tensors[name] = fmt.dequantize(fmt.quantize(w)).contiguous()
    save_file(tensors, dst / "model.safetensors")
    shutil.copy(src / "config.json", dst / "config.json")
    return dst


def _prefill_logits(engine: LLMEngine, ids: list[int], phase: str | None = None) -> torch.Tensor:
    seq = engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0.0))
    batch = engine.scheduler.schedule()
    input_ids, meta = engine.runner.prepare(batch)
    meta.logits_rows = torch.arange(len(ids))
    logits = engine.model.forward(input_ids, meta, engine.cache, phase)
    engine.scheduler.finish(seq, "stop")
    return logits


def _engine(path: Path, **kw) -> LLMEngine:
    return LLMEngine.from_pretrained(path, EngineConfig(dtype="float32", kv_format="fp32", kv_cache_bytes=4 * 2**20,
                                                        **kw))


CASES = [("llama", {}), ("qwen2", {}), ("llama", {"tie_word_embeddings": True})]


@pytest.mark.parametrize("arch,overrides", CASES, ids=["llama", "qwen2-bias", "llama-tied"])
@pytest.mark.parametrize("name,group", [("int4", 128), ("int4", 32), ("fp8", 128)])
def test_quantised_model_logits_match_the_dequantised_dense_model(tmp_path: Path, arch: str, overrides: dict,
                                                                  name: str, group: int) -> None:
    path = _sharpen_attention(write_tiny_model(tmp_path / "m", arch, seed=11, **overrides))
    fmt = weight_format(name, group)
    reference = _engine(_dequantised_copy(path, tmp_path / "deq", fmt))
    ours = _engine(path, prefill_weights=name, decode_weights=name, int4_group_size=group)
    assert repr(ours.model.formats["prefill"]) == repr(fmt)
    ids = torch.randint(0, 320, (40,)).tolist()
    expected = _prefill_logits(reference, ids)
    got = _prefill_logits(ours, ids)
    # fp8 on CPU is dequantised at load: float32 all the way. int4 runs on bf16 activations.
    tol = 1e-4 if name == "fp8" else 2e-2 * expected.abs().max().item()
    assert (got - expected).abs().max().item() <= tol
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9


def test_each_phase_uses_its_format(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompt rows run the prefill format's linears, decode rows the decode format's, in mixed steps too."""
    path = write_tiny_model(tmp_path / "m", "llama", seed=2)
    engine = _engine(path, prefill_weights="fp32", decode_weights="int4", max_num_batched_tokens=64)
    engine.model.fused_decode = False  # the Python layers' dispatch is under test (a fused step calls none)
    layers = engine.model.phase_layers
    assert all(isinstance(l.qkv, Int4Linear) for l in layers["decode"])
    assert all(isinstance(l.qkv, Linear) for l in layers["prefill"])
    calls = {"int4": 0, "dense": 0}
    int4_call, dense_call = Int4Linear.__call__, Linear.__call__

    def count(kind, original):
        def spy(self, x):
            calls[kind] += 1
            return original(self, x)
        return spy

    monkeypatch.setattr(Int4Linear, "__call__", count("int4", int4_call))
    monkeypatch.setattr(Linear, "__call__", count("dense", dense_call))
    per_step = 4 * len(layers["decode"])  # qkv, o, gate_up, down per layer

    def step() -> dict[str, int]:
        before = dict(calls)
        engine.step()
        return {k: calls[k] - before[k] for k in calls}

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine.add_request(list(range(5, 25)), params)
    assert step() == {"int4": 0, "dense": per_step + 1}  # prefill (+ the LM head, dense)
    assert step() == {"int4": per_step, "dense": 1}  # decode: INT4 linears, dense LM head
    engine.add_request(list(range(30, 40)), params)
    # a decode row beside a prompt that completes: each linear twice (decode row on INT4, prompt rows
    # on FP32), the LM head once per row group
    assert step() == {"int4": per_step, "dense": per_step + 2}
    assert step() == {"int4": per_step, "dense": 1}
    assert engine.model.steps_by_phase == {"prefill": 1, "decode": 2, "mixed": 1}


def test_memory_of_one_and_two_formats(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "m", "llama", seed=4)
    one = _engine(path, prefill_weights="fp32", decode_weights="fp32", gemm_buckets=()).model
    assert one.phase_layers["prefill"] is one.phase_layers["decode"]
    m1 = one.weight_memory()
    assert m1["prefill"] == m1["decode"] and m1["packs"] == 0
    assert m1["total"] == m1["shared"] + m1["prefill"]
    cfg = one.cfg
    linear_params = cfg.num_layers * (cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
                                      + cfg.hidden_size * cfg.num_heads * cfg.head_dim
                                      + 3 * cfg.hidden_size * cfg.intermediate_size)
    assert m1["prefill"] == 4 * linear_params
    two = _engine(path, prefill_weights="fp32", decode_weights="int4", gemm_buckets=()).model.weight_memory()
    assert two["prefill"] == m1["prefill"] and two["shared"] == m1["shared"]
    assert two["total"] == two["shared"] + two["prefill"] + two["decode"]
    assert 0.125 * m1["prefill"] < two["decode"] < 0.2 * m1["prefill"]  # 4 bits + bf16 scales and zeros


def test_a_linear_of_the_wrong_shape_is_named(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "m", "llama", seed=1)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.2.mlp.down_proj.weight"] = tensors["model.layers.2.mlp.down_proj.weight"][:, :64].clone()
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(WeightsError, match=r"model\.layers\.2\.mlp\.down_proj"):
        _engine(path, decode_weights="int4")


def test_fp8_tensors_without_a_quantization_config_are_refused(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "m", "llama", seed=1)
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.0.self_attn.o_proj.weight"
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(WeightsError, match="o_proj.weight is torch.float8_e4m3fn"):
        _engine(path)
    raw = json.loads((path / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(WeightsError, match="unknown weight format"):
        _engine(path)


def test_dense_formats_resolve_against_the_compute_dtype(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "m", "llama", seed=1)
    model = _engine(path).model
    assert model.formats == {"prefill": model.formats["prefill"], "decode": model.formats["decode"]}
    assert isinstance(model.formats["decode"], DenseFormat) and repr(model.formats["decode"]) == "fp32"
