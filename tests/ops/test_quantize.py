"""`edgeserve quantize`: streamed output that loads like quantise-at-load, the size report, atomic failures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from backend.config import load_config
from backend.engine import EngineConfig, LLMEngine
from backend.errors import WeightsError
from backend.models.checkpoint_layout import checkpoint_layout
from backend.weight_formats import stored_format, weight_format
from backend.weights import CheckpointReader
from ops import quantize
from ops.cli import main
from tests.backend.test_weight_formats import _prefill_logits
from tests.backend.tiny_models import write_tiny_glm4_moe, write_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama checkpoint in BF16 (like the real source), with tokenizer-like side files."""
    path = write_tiny_model(tmp_path_factory.mktemp("src") / "m", "llama", seed=7)
    tensors = {n: t.bfloat16() for n, t in load_file(path / "model.safetensors").items()}
    save_file(tensors, path / "model.safetensors")
    (path / "special_tokens_map.json").write_text('{"eos_token": "x"}')  # a tokenizer side file
    (path / ".edgeserve-complete").write_text("{}")
    return path


def _engine(path: Path, **kw) -> LLMEngine:
    return LLMEngine.from_pretrained(path, EngineConfig(dtype="float32", kv_format="fp32", kv_cache_bytes=2**21,
                                                        **kw))


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".tmp-" in p.name)


@pytest.mark.parametrize("to,group", [("int4", 128), ("int4", 32), ("fp8", 128)])
def test_output_loads_and_equals_quantise_at_load(tiny: Path, tmp_path: Path, to: str, group: int) -> None:
    out = tmp_path / "q"
    report = quantize.quantize_checkpoint(tiny, out, weight_format(to, group), progress=False)
    raw = json.loads((out / "config.json").read_text())
    assert raw["quantization_config"] == weight_format(to, group).quantization_config()
    assert (out / "special_tokens_map.json").read_text() == '{"eos_token": "x"}'
    assert not (out / ".edgeserve-complete").exists()  # pull's marker is not a model file
    assert not _leftovers(tmp_path)
    ids = list(range(3, 43))
    direct = _engine(out)  # the format as stored
    at_load = _engine(tiny, prefill_weights=to, decode_weights=to, int4_group_size=group)
    assert repr(direct.model.formats["decode"]) == repr(at_load.model.formats["decode"])
    assert torch.equal(_prefill_logits(direct, ids), _prefill_logits(at_load, ids))
    # the report is what is on disk
    reader = CheckpointReader(out)
    specs = {n: reader.spec(n) for n in reader.names()}
    assert report.output_bytes == sum(s.nbytes for s in specs.values())
    assert report.input_bytes == sum(CheckpointReader(tiny).spec(n).nbytes for n in CheckpointReader(tiny).names())
    linear = sum(s.nbytes for n, s in specs.items() if "_proj." in n)
    assert report.output_linear_bytes == linear and report.per_gpu_bytes[1] == report.output_bytes
    assert report.ratio == report.output_bytes / report.input_bytes


def test_fp8_to_int4_goes_through_the_dequantised_fp8(tiny: Path, tmp_path: Path) -> None:
    fp8 = tmp_path / "fp8"
    quantize.quantize_checkpoint(tiny, fp8, weight_format("fp8"), progress=False)
    int4 = tmp_path / "int4"
    quantize.quantize_checkpoint(fp8, int4, weight_format("int4", 32), progress=False)
    assert load_config(int4).quantization["quant_method"] == "edgeserve_int4"
    ids = list(range(5, 30))
    via_file = _prefill_logits(_engine(int4), ids)
    at_load = _prefill_logits(_engine(fp8, prefill_weights="int4", decode_weights="int4", int4_group_size=32), ids)
    assert torch.equal(via_file, at_load)
    fmt, fp8_fmt = weight_format("int4", 32), weight_format("fp8")
    name = "model.layers.1.mlp.up_proj"
    expected = fmt.quantize(fp8_fmt.dequantize(fp8_fmt.read(CheckpointReader(fp8).get, name)))
    stored = fmt.read(CheckpointReader(int4).get, name)
    assert all(torch.equal(stored.tensors[s], expected.tensors[s]) for s in fmt.suffixes)


def test_shards_and_index(tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "sharded"
    quantize.quantize_checkpoint(tiny, out, weight_format("int4", 128), shard_bytes=40_000, progress=False)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    ids = list(range(7, 20))
    assert torch.equal(_prefill_logits(_engine(out), ids),
                       _prefill_logits(_engine(tiny, prefill_weights="int4", decode_weights="int4"), ids))


def test_per_gpu_bytes_split_and_replicate() -> None:
    from backend.config import ModelConfig
    from backend.weight_formats import TensorSpec

    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64,
                      num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64,
                      rms_norm_eps=1e-5, rope_theta=1e4, rope_scaling=None, tie_word_embeddings=True,
                      attention_bias=False)
    specs = {"model.layers.0.self_attn.q_proj.qweight": TensorSpec(torch.uint8, (32, 16)),  # 512 B
             "model.layers.0.self_attn.k_proj.qweight": TensorSpec(torch.uint8, (16, 16)),  # 256 B, 2 KV heads
             "model.layers.0.input_layernorm.weight": TensorSpec(torch.bfloat16, (32,)),  # 64 B, replicated
             "model.embed_tokens.weight": TensorSpec(torch.bfloat16, (64, 32))}  # 4096 B, vocab-parallel
    assert quantize.per_gpu_bytes(specs, cfg, 1) == 512 + 256 + 64 + 4096
    assert quantize.per_gpu_bytes(specs, cfg, 8) == 64 + 128 + 64 + 512  # k_proj: one KV head per GPU
    # MLA's latent down-projections and the DSA indexer stay whole on every rank (distributed/sharding.py)
    mla = {"model.layers.0.self_attn.q_a_proj.qweight": TensorSpec(torch.uint8, (32, 16)),  # 512 B, replicated
           "model.layers.0.self_attn.q_b_proj.qweight": TensorSpec(torch.uint8, (64, 16)),  # 1024 B, split
           "model.layers.0.self_attn.indexer.wq_b.qweight": TensorSpec(torch.uint8, (16, 16))}  # 256 B, replicated
    assert quantize.per_gpu_bytes(mla, cfg, 8) == 512 + 128 + 256


@pytest.mark.parametrize("case", ["unknown_format", "missing_tensor", "missing_scale", "bad_group", "bad_scale_shape",
                                  "already_target", "fails_midway", "exists", "gptq_fails_midway",
                                  "calib_too_short", "calib_no_tokenizer", "gptq_to_fp8"])
def test_bad_input_leaves_nothing_behind(tiny: Path, tiny_chat_dir: Path, tmp_path: Path, case: str,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    gptq = case.startswith(("gptq", "calib"))  # these start from a model with a tokenizer (calibration text)
    src = tmp_path / "src"
    src.mkdir()
    for f in (tiny_chat_dir if gptq and case != "calib_no_tokenizer" else tiny).iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    out = tmp_path / "out"
    target = "int4"
    group = 128
    match = None
    extra = ["--method", "gptq" if gptq else "rtn", "--calib-tokens", "256"]
    if case == "unknown_format":
        raw = json.loads((src / "config.json").read_text())
        raw["quantization_config"] = {"quant_method": "gptq", "bits": 4}
        (src / "config.json").write_text(json.dumps(raw))
        match = "unknown weight format"
    elif case == "missing_tensor":
        tensors = load_file(src / "model.safetensors")
        del tensors["model.layers.2.self_attn.v_proj.weight"]
        save_file(tensors, src / "model.safetensors")
        match = r"model\.layers\.2\.self_attn\.v_proj\.weight"
    elif case in ("missing_scale", "bad_scale_shape", "already_target"):
        quantize.quantize_checkpoint(tiny, tmp_path / "fp8", weight_format("fp8"), progress=False)
        src = tmp_path / "fp8"
        tensors = load_file(src / "model.safetensors")
        name = "model.layers.0.mlp.down_proj.weight_scale_inv"
        if case == "missing_scale":
            del tensors[name]
            match = "down_proj.weight_scale_inv"
        elif case == "bad_scale_shape":
            tensors[name] = torch.ones(2, 2)
            match = "do not fit fp8"
        else:
            target, match = "fp8", "already fp8"
        save_file(tensors, src / "model.safetensors")
    elif case == "bad_group":
        group, match = 48, "group size 48"
    elif case == "calib_too_short":
        (tmp_path / "short.txt").write_text("Too short to calibrate on.")
        extra += ["--calib-file", str(tmp_path / "short.txt")]
        match = r"short\.txt\) gives \d+ tokens, fewer than the --calib-tokens 256"
    elif case == "calib_no_tokenizer":
        match = "no tokenizer.json; use --method rtn"
    elif case == "gptq_to_fp8":
        target, match = "fp8", "gptq quantises to INT4"
    elif case in ("fails_midway", "gptq_fails_midway"):
        calls = []
        original = quantize.write_safetensors

        def failing(path, specs, tensors, metadata=None):
            def stop_after_five():
                for item in tensors:
                    calls.append(item[0])
                    if len(calls) > 5:
                        raise WeightsError("corrupt tensor (injected)")
                    yield item
            return original(path, specs, stop_after_five(), metadata)

        monkeypatch.setattr(quantize, "write_safetensors", failing)
        match = "injected"
    elif case == "exists":
        out.mkdir()
        (out / "keep").write_text("mine")
        match = "already exists"
    argv = ["quantize", str(src), str(out), "--to", target, "--group-size", str(group), "--no-progress", *extra]
    with pytest.raises(WeightsError, match=match):
        quantize.run(_args(argv))
    assert main(argv) == 2  # the CLI prints the typed error and exits 2
    assert not _leftovers(tmp_path)
    if case == "exists":
        assert (out / "keep").read_text() == "mine" and sorted(p.name for p in out.iterdir()) == ["keep"]
    else:
        assert not out.exists()


def _args(argv: list[str]):
    from ops.cli import build_parser

    return build_parser().parse_args(argv)


def test_cli_prints_the_size_report(tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["quantize", str(tiny), str(tmp_path / "q"), "--to", "fp8", "--no-progress"]) == 0
    text = capsys.readouterr().out
    for line in ("input", "output", "ratio", "linear layers", "per GPU, TP 1", "per GPU, TP 8"):
        assert line in text


# --- mixture-of-experts checkpoints (Glm4Moe) -------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Glm4Moe (one dense layer, two MoE layers of 8 experts in 2 groups, a shared expert) with
    one MTP layer stored after the last. moe_intermediate_size 128 keeps FP8's 128-row scale blocks
    whole when the loader stacks an expert's gate and up rows (so FP8 loads without re-rounding)."""
    return write_tiny_glm4_moe(tmp_path_factory.mktemp("moe") / "m", seed=11, mtp_layers=1, n_group=2, topk_group=1,
                               moe_intermediate_size=128)


def _moe_engine(path: Path, **kw) -> LLMEngine:
    return LLMEngine.from_pretrained(path, EngineConfig(dtype="float32", kv_format="fp32", kv_cache_bytes=2**21,
                                                        gemm_buckets=(), **kw))


def _dequantized_copy(src: Path, dst: Path) -> Path:
    """`src` (a quantised checkpoint) with every linear dequantised to a float32 `.weight`: the operand
    the quantised model computes with, as a dense checkpoint."""
    cfg = load_config(src)
    fmt = stored_format(cfg.quantization)
    reader = CheckpointReader(src)
    linears = set(checkpoint_layout(cfg).linears)
    tensors = {}
    for name in reader.names():
        module = name.rsplit(".", 1)[0]
        if module not in linears:
            tensors[name] = reader.get(name)
        elif name == f"{module}.{fmt.suffixes[0]}":
            tensors[f"{module}.weight"] = fmt.dequantize(fmt.read(reader.get, module)).float()
    dst.mkdir()
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((src / "config.json").read_text())
    del raw["quantization_config"]
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


@pytest.mark.parametrize("to,group,weight_rtol,dense_rtol", [("int4", 32, 0.12, 0.8), ("fp8", 128, 0.04, 0.45)])
def test_moe_checkpoint_quantises_experts_keeps_router_and_loads(tiny_moe: Path, tmp_path: Path, to: str,
                                                                 group: int, weight_rtol: float,
                                                                 dense_rtol: float) -> None:
    out = tmp_path / "q"
    fmt = weight_format(to, group)
    report = quantize.quantize_checkpoint(tiny_moe, out, fmt, progress=False)
    cfg = load_config(out)
    src, dst = CheckpointReader(tiny_moe), CheckpointReader(out)
    names = set(dst.names())
    moe_layers = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
    assert moe_layers == [1, 2] and cfg.num_experts == 8
    # every routed and shared expert projection is stored in the target format, nothing of it dense
    experts = [f"model.layers.{i}.mlp.{e}.{p}_proj" for i in moe_layers
               for e in [*(f"experts.{j}" for j in range(cfg.num_experts)), "shared_experts"]
               for p in ("gate", "up", "down")]
    for module in experts:
        stored = {s: dst.spec(f"{module}.{s}") for s in fmt.suffixes}
        assert stored == fmt.specs(tuple(src.spec(f"{module}.weight").shape))
        if to == "int4":
            assert f"{module}.weight" not in names and stored["qweight"].dtype == torch.uint8
        else:
            assert stored["weight"].dtype == torch.float8_e4m3fn
        w = src.get(f"{module}.weight").float()
        err = (fmt.dequantize(fmt.read(dst.get, module)) - w).norm() / w.norm()
        assert 0 < err < weight_rtol  # quantised, and close to the source weight
    assert report.output_linear_bytes < report.input_linear_bytes / (6 if to == "int4" else 3)
    # the router, norms, embeddings, LM head and the MTP layer (not run) are the input's bytes
    kept = [n for n in src.names() if not n.endswith("_proj.weight") or n.startswith(f"model.layers.{cfg.num_layers}.")]
    for i in moe_layers:
        assert {f"model.layers.{i}.mlp.gate.weight", f"model.layers.{i}.mlp.gate.e_score_correction_bias"} <= set(kept)
    assert any(n.startswith(f"model.layers.{cfg.num_layers}.mlp.experts.") for n in kept)
    for name in kept:
        a, b = src.get(name), dst.get(name)
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    # the engine loads it and stays near the dense model (routing flips make tiny random models
    # sensitive: a whole-logits relative error of ~0.2 for FP8, ~0.5 for INT4; an unrelated model ~1.4)
    ids = torch.randint(3, 320, (29,)).tolist()
    got = _prefill_logits(_moe_engine(out), ids)
    dense = _prefill_logits(_moe_engine(tiny_moe), ids)
    assert 0 < ((got - dense).norm() / dense.norm()).item() < dense_rtol
    if to == "fp8":  # FP8 runs dequantised on CPU: exactly the dequantised operand as a dense checkpoint
        operand = _prefill_logits(_moe_engine(_dequantized_copy(out, tmp_path / "deq")), ids)
        assert (got - operand).abs().max().item() <= 1e-5
    else:  # INT4 runs bf16 activations (a routing flip away from any dense operand): equal to what
        # quantise-at-load makes of the dense checkpoint, bit for bit
        at_load = _moe_engine(tiny_moe, prefill_weights="int4", decode_weights="int4", int4_group_size=group)
        assert torch.equal(got, _prefill_logits(at_load, ids))


def test_moe_checkpoint_with_a_missing_expert_is_refused_before_writing(tiny_moe: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for f in tiny_moe.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    tensors = load_file(src / "model.safetensors")
    del tensors["model.layers.2.mlp.experts.5.down_proj.weight"]
    save_file(tensors, src / "model.safetensors")
    with pytest.raises(WeightsError, match=r"model\.layers\.2\.mlp\.experts\.5\.down_proj\.weight"):
        quantize.quantize_checkpoint(src, tmp_path / "out", weight_format("fp8"), progress=False)
    assert not (tmp_path / "out").exists() and not _leftovers(tmp_path)


def test_checkpoint_layout_per_architecture(tmp_path: Path) -> None:
    """Llama's linears are its attention and MLP projections per layer (as before MoE); Glm4Moe's dense
    layers have the MLP, its MoE layers every expert and the shared one, and the router is required."""
    llama = load_config(write_tiny_model(tmp_path / "l", "llama", num_hidden_layers=2))
    layout = checkpoint_layout(llama)
    assert layout.linears == [f"model.layers.{i}.{n}" for i in range(2) for n in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    assert not any("gate.weight" in n for n in layout.required)
    glm = load_config(write_tiny_glm4_moe(tmp_path / "g", use_qk_norm=True, n_shared_experts=0))
    layout = checkpoint_layout(glm)
    assert "model.layers.0.mlp.down_proj" in layout.linears and "model.layers.1.mlp.down_proj" not in layout.linears
    assert [m for m in layout.linears if ".mlp.experts." in m][:3] == [
        f"model.layers.1.mlp.experts.0.{p}_proj" for p in ("gate", "up", "down")]
    assert len([m for m in layout.linears if ".mlp.experts." in m]) == 2 * 8 * 3
    assert not any("shared_experts" in m for m in layout.linears)  # n_shared_experts 0
    assert {"model.layers.1.mlp.gate.weight", "model.layers.2.self_attn.k_norm.weight"} <= set(layout.required)
    assert "model.layers.0.mlp.gate.weight" not in layout.required  # a dense layer has no router


def test_fused_experts_are_written_per_expert(tiny_moe: Path, tmp_path: Path) -> None:
    """Experts stored fused (gate_up_proj [E, 2I, H], down_proj [E, H, I], as newer transformers holds
    them) come out under the per-expert names, tensor for tensor what the per-expert input gives."""
    cfg = load_config(tiny_moe)
    tensors = load_file(tiny_moe / "model.safetensors")
    for i in (1, 2):
        p = f"model.layers.{i}.mlp.experts."
        per = {n: [tensors.pop(f"{p}{j}.{n}.weight") for j in range(cfg.num_experts)]
               for n in ("gate_proj", "up_proj", "down_proj")}
        tensors[f"{p}gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(per["gate_proj"], per["up_proj"])])
        tensors[f"{p}down_proj"] = torch.stack(per["down_proj"])
    fused = tmp_path / "fused"
    fused.mkdir()
    save_file(tensors, fused / "model.safetensors", metadata={"format": "pt"})
    (fused / "config.json").write_text((tiny_moe / "config.json").read_text())
    fmt = weight_format("int4", 32)
    report = quantize.quantize_checkpoint(fused, tmp_path / "a", fmt, shard_bytes=60_000, progress=False)
    quantize.quantize_checkpoint(tiny_moe, tmp_path / "b", fmt, progress=False)
    a, b = CheckpointReader(tmp_path / "a"), CheckpointReader(tmp_path / "b")
    assert sorted(a.names()) == sorted(b.names())
    assert "model.layers.2.mlp.experts.7.up_proj.qweight" in set(a.names())
    assert all(torch.equal(a.get(n), b.get(n)) for n in a.names())
    assert report.input_linear_bytes == sum(t.nbytes for n, t in tensors.items()
                                            if n.endswith(("_proj.weight", "_proj")) and ".layers.3." not in n)


def test_kimi_wrapped_checkpoint_is_quantised_under_its_prefix(tmp_path: Path) -> None:
    """A Kimi K2.x folder (DeepseekV3 text model under `language_model.`, beside a vision tower):
    its text model is converted exactly as the plain folder is, written back under the prefix, and
    serves the same logits (the vision tower is not the text model and is not written)."""
    from tests.backend.test_checkpoint_prefix import wrap
    from tests.backend.tiny_mla_models import write_tiny_deepseek_v3

    plain = write_tiny_deepseek_v3(tmp_path / "m", seed=6)
    wrapped = wrap(plain, tmp_path / "w")
    raw = json.loads((wrapped / "config.json").read_text())
    raw["architectures"] = ["Kimi_K25ForConditionalGeneration"]
    (wrapped / "config.json").write_text(json.dumps(raw))
    fmt = weight_format("int4", 32)
    quantize.quantize_checkpoint(wrapped, tmp_path / "qw", fmt, progress=False)
    quantize.quantize_checkpoint(plain, tmp_path / "qp", fmt, progress=False)
    got = load_file(tmp_path / "qw" / "model.safetensors")
    want = load_file(tmp_path / "qp" / "model.safetensors")
    assert sorted(got) == sorted(f"language_model.{n}" for n in want)
    assert all(torch.equal(got[f"language_model.{n}"], t) for n, t in want.items())
    ids = list(range(3, 33))
    assert torch.equal(_prefill_logits(_engine(tmp_path / "qw"), ids), _prefill_logits(_engine(tmp_path / "qp"), ids))
