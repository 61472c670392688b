"""The size plan from a config alone: its tensor list is what transformers writes, its bytes are what
`edgeserve quantize` writes, and from the GLM-5 config it reproduces the public 705 -> 421 GiB and
~88 -> ~52 GiB per GPU with every difference the module docstring explains, figure by figure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from backend.compressed_tensors import PackQuantizedWriter
from backend.config import ModelConfig, load_config
from backend.errors import InvalidRequest
from backend.weights import CheckpointReader
from ops.model_configs import known_config, load_model_config
from ops.quantize_ignore import DEFAULT_IGNORE, KIMI_IGNORE
from ops.quantize_plan import (CLASSES, GB, GIB, config_tensors, format_plan, plan_sizes, plan_to_json,
                               print_plan)
from tests.backend.test_glm_moe_dsa import write_tiny_glm_moe_dsa
from tests.backend.tiny_models import write_tiny_glm4_moe


@pytest.fixture(scope="module")
def glm5() -> ModelConfig:
    return load_model_config("glm-5")[1]


@pytest.fixture(scope="module")
def plan(glm5: ModelConfig):
    return plan_sizes(glm5, "int4", 32, 8, KIMI_IGNORE, source="fp8", model="glm-5")


def _gib(n: int) -> float:
    return round(n / GIB, 2)


def test_glm5_reproduces_the_write_up_in_gib(plan) -> None:
    assert plan.params == 753_864_139_008
    assert plan.source_bytes == 756_162_687_872 and _gib(plan.source_bytes) == 704.23  # the write-up's 705
    assert plan.target_bytes == 451_972_602_368 and _gib(plan.target_bytes) == 420.93  # its 421
    assert abs(plan.source_bytes / GIB - 705) < 1 and abs(plan.target_bytes / GIB - 421) < 0.5
    assert round(plan.source_bytes / GB, 2) == 756.16 and round(plan.target_bytes / GB, 2) == 451.97  # not GB
    assert (_gib(plan.source_per_gpu), _gib(plan.target_per_gpu)) == (90.00, 56.22)
    assert (_gib(plan.source_bytes // 8), _gib(plan.target_bytes // 8)) == (88.03, 52.62)  # its ~88 -> ~52


def test_glm5_arithmetic_of_the_explanation(glm5: ModelConfig, plan) -> None:
    tensors = config_tensors(glm5, 8)
    fp8 = [t for t in tensors if t.fp8]
    e4m3 = sum(t.numel for t in fp8)
    scales = sum(4 * -(-t.shape[0] // 128) * -(-t.shape[1] // 128) for t in fp8)
    bias = sum(t.numel for t in tensors if t.name.endswith("e_score_correction_bias"))
    bf16 = sum(t.numel for t in tensors if not t.fp8) - bias
    assert (e4m3, scales, bf16, bias) == (751_749_169_152, 183_540_096, 2_114_950_400, 19_456)
    assert e4m3 + scales + 2 * bf16 + 4 * bias == plan.source_bytes
    rows = {r.cls: r for r in plan.rows}
    experts = rows["routed_experts"]
    assert (experts.params, experts.tensors) == (734_439_407_616, 58_368) == (experts.target_params, 58_368)
    assert experts.target_bytes == experts.params * 9 // 16 + 16 * experts.tensors  # 0.5 + 2/32 B per weight
    others = plan.params - experts.params
    assert others == 19_424_731_392 and plan.target_bytes == experts.target_bytes + 2 * others + 2 * bias
    assert round(experts.params / plan.params, 3) == 0.974
    assert round(plan.mtp_source_bytes / GB, 2) == 10.03 and round(plan.mtp_target_bytes / GB, 2) == 6.01
    indexer = [t for t in tensors if ".indexer." in t.name and not t.name.endswith(("k_norm.weight", "k_norm.bias"))]
    assert len({t.name.split(".")[2] for t in indexer}) == 79 and round(sum(t.numel for t in indexer) / 1e9, 2) == 0.74
    # the alternatives the docstring prices
    alt = {name: _gib(plan_sizes(glm5, "int4", g, 8, ignore, source="fp8", **kw).target_bytes)
           for name, g, ignore, kw in [("default list", 32, DEFAULT_IGNORE, {}),
                                       ("ignored stay fp8", 32, KIMI_IGNORE, {"keep": "source"}),
                                       ("mtp copied", 32, KIMI_IGNORE, {"mtp": "source"}),
                                       ("mtp dropped", 32, KIMI_IGNORE, {"mtp": "drop"}),
                                       ("scale + zero", 32, KIMI_IGNORE, {"scheme": "edgeserve"}),
                                       ("g128", 128, KIMI_IGNORE, {})]}
    assert alt == {"default list": 400.28, "ignored stay fp8": 404.82, "mtp copied": 424.67, "mtp dropped": 415.33,
                   "scale + zero": 463.68, "g128": 388.87}
    assert round((e4m3 - experts.params) / 1e9, 2) == 17.31  # FP8 weights the kimi list keeps, written BF16
    # per GPU: the total over 8 plus 7/8 of every replicated tensor's bytes
    replicated = [t for t in tensors if t.split == 1]
    dense = {t.name: (4 if t.name.endswith("e_score_correction_bias") else 2) * t.numel for t in replicated}
    rep_src = sum(t.numel + 4 * -(-t.shape[0] // 128) * -(-t.shape[1] // 128) if t.fp8 else dense[t.name]
                  for t in replicated)
    rep_tgt = sum(dense.values())
    assert (round(rep_src / GB, 2), round(rep_tgt / GB, 2)) == (2.42, 4.42)
    assert plan.source_per_gpu * 8 == plan.source_bytes + 7 * rep_src
    assert plan.target_per_gpu * 8 == plan.target_bytes + 7 * rep_tgt


def test_tensor_list_is_what_transformers_writes(tmp_path: Path) -> None:
    """Names and shapes of a tiny GlmMoeDsa (MLA, indexer on its "full" layers, dense and MoE layers)
    and a tiny Glm4Moe with biases and q/k norms, as `save_pretrained` writes them."""
    for path in (write_tiny_glm_moe_dsa(tmp_path / "dsa", seed=2),
                 write_tiny_glm4_moe(tmp_path / "gqa", seed=2, attention_bias=True, use_qk_norm=True)):
        written = {n: tuple(t.shape) for n, t in load_file(path / "model.safetensors").items()}
        planned = {t.name: t.shape for t in config_tensors(load_config(path))}
        assert planned == written


def _bf16_copy(src: Path, dst: Path) -> Path:
    """`src` with its float32 tensors in bfloat16, the router's correction bias kept float32 (as shipped)."""
    dst.mkdir()
    tensors = {n: t if n.endswith("e_score_correction_bias") else t.bfloat16()
               for n, t in load_file(src / "model.safetensors").items()}
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


def _stored_bytes(path: Path) -> int:
    reader = CheckpointReader(path)
    return sum(reader.spec(n).nbytes for n in reader.names())


def test_plan_is_what_quantize_writes(tmp_path: Path) -> None:
    """BF16 and FP8 inputs of a tiny Glm4Moe, converted by `edgeserve quantize` to pack-quantized INT4
    g32: the plan's source and target bytes are the checkpoints' tensor bytes."""
    from backend.weight_formats import weight_format
    from ops.quantize import quantize_checkpoint

    bf16 = _bf16_copy(write_tiny_glm4_moe(tmp_path / "m", seed=4), tmp_path / "bf16")
    fp8 = tmp_path / "fp8"
    quantize_checkpoint(bf16, fp8, weight_format("fp8"), progress=False)
    cfg = load_config(bf16)
    for src, source in ((bf16, "bf16"), (fp8, "fp8")):
        out = tmp_path / f"int4-{source}"
        quantize_checkpoint(src, out, PackQuantizedWriter(32, DEFAULT_IGNORE), progress=False)
        report = plan_sizes(cfg, "int4", 32, 8, DEFAULT_IGNORE, source=source)
        assert report.source_bytes == _stored_bytes(src)
        assert report.target_bytes == _stored_bytes(out)
        rows = {r.cls: r for r in report.rows}
        assert rows["lm_head"].target_params == 0 and rows["attention"].target_params == rows["attention"].params
    zp = tmp_path / "int4-zp"  # --zero-points: weight_zero_point int32 [ceil(N/8), K/g] more
    quantize_checkpoint(bf16, zp, PackQuantizedWriter(32, DEFAULT_IGNORE, symmetric=False), progress=False)
    report = plan_sizes(cfg, "int4", 32, 8, DEFAULT_IGNORE, source="bf16", scheme="compressed-tensors-zp")
    assert report.target_bytes == _stored_bytes(zp) > _stored_bytes(tmp_path / "int4-bf16")


def test_per_gpu_split_rules() -> None:
    raw = {**known_config("glm-4.6"), "num_hidden_layers": 2, "first_k_dense_replace": 1, "n_routed_experts": 4,
           "num_experts_per_tok": 2, "num_nextn_predict_layers": 0, "num_key_value_heads": 4}
    tensors = {t.name: t for t in config_tensors(ModelConfig.from_dict(raw), tp=8)}
    a = "model.layers.0.self_attn."
    assert tensors[f"{a}q_proj.weight"].split == 8 and tensors[f"{a}o_proj.weight"].split == 8
    assert tensors[f"{a}k_proj.weight"].split == 4 == tensors[f"{a}v_proj.bias"].split  # 4 KV heads: replicated 2x
    assert tensors["model.layers.1.mlp.gate.weight"].split == 1 and tensors["model.norm.weight"].split == 1
    assert tensors["model.layers.1.mlp.experts.3.down_proj.weight"].split == 8
    assert tensors["model.embed_tokens.weight"].split == 8 == tensors["lm_head.weight"].split
    dsv3 = {t.name: t for t in config_tensors(load_model_config("deepseek-v3")[1], tp=8)}
    a = "model.layers.0.self_attn."
    assert dsv3[f"{a}q_a_proj.weight"].split == 1 == dsv3[f"{a}kv_a_proj_with_mqa.weight"].split
    assert dsv3[f"{a}q_b_proj.weight"].split == 8 == dsv3[f"{a}kv_b_proj.weight"].split
    assert dsv3["model.layers.61.eh_proj.weight"].split == 1 and dsv3["model.layers.61.eh_proj.weight"].mtp


def test_table_and_json(plan, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    table = format_plan(plan)
    assert "704.23" in table and "420.93" in table and "routed_experts" in table
    assert [line.split()[0] for line in table.splitlines()[4:4 + len(plan.rows)]] == \
        [c for c in CLASSES if c in {r.cls for r in plan.rows}]
    data = json.loads(json.dumps(plan_to_json(plan)))
    assert data["target_bytes"] == plan.target_bytes and round(data["target_bytes_gib"], 2) == 420.93
    assert sum(r["source_bytes"] for r in data["rows"]) == data["source_bytes"]
    report = print_plan("glm-5", ignore=KIMI_IGNORE, json_path=tmp_path / "plan.json", source="fp8")
    assert report == plan and "wrote" in capsys.readouterr().out
    assert json.loads((tmp_path / "plan.json").read_text())["target_bytes"] == plan.target_bytes


@pytest.mark.parametrize("kw, match", [
    ({"to": "int8"}, "unknown target 'int8'"),
    ({"source": "fp4"}, "unknown source 'fp4'"),
    ({"mtp": "keep"}, "unknown mtp 'keep'"),
    ({"group_size": 48}, "group size 48"),
    ({"source": "fp8", "to": "fp8"}, "already fp8"),
    ({"tp": 0}, "tensor parallel"),
    ({"ignore": ["re:("]}, "not a valid regex"),
])
def test_bad_input_is_an_invalid_request(glm5: ModelConfig, kw: dict, match: str) -> None:
    with pytest.raises(InvalidRequest, match=match):
        plan_sizes(glm5, **{"source": "bf16", **kw})


def test_a_stored_int4_config_needs_a_named_source_and_groups_must_divide() -> None:
    kimi = load_model_config("kimi-k2.6")[1]
    with pytest.raises(InvalidRequest, match="'compressed-tensors'.*source 'bf16' or 'fp8'"):
        plan_sizes(kimi)
    report = plan_sizes(kimi, ignore=KIMI_IGNORE, source="bf16")  # Kimi's own layout from a BF16 original
    assert round(report.target_bytes / GB, 1) == 594.2 and round(report.params / 1e9, 1) == 1026.4
    tiny = ModelConfig.from_dict({**known_config("glm-4.6"), "hidden_size": 96, "num_hidden_layers": 1})
    with pytest.raises(InvalidRequest, match=r"model\.layers\.0\.self_attn\.q_proj\.weight: in_features 96"):
        plan_sizes(tiny, group_size=64, source="bf16")
    assert plan_sizes(tiny, group_size=64, source="bf16", scheme="edgeserve").target_bytes > 0  # partial groups
