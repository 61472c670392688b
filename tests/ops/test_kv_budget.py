"""`edgeserve kv-budget`: the published configs, the byte and token figures they give, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from backend.config import ModelConfig
from backend.errors import InvalidRequest, ModelLoadError, ModelNotFound
from ops.cli import main
from ops.kv_budget import GIB, PER_TENSOR_FP8, gqa_kv_heads_per_gpu, kv_budget, latent_row_bytes
from ops.model_configs import KNOWN_CONFIGS, known_config, load_model_config

FREE = int(46.8 * GIB)


def _rows(name: str, tp: int = 8, page_size: int = 16) -> dict:
    label, cfg = load_model_config(name)
    return {r.kv_format: r for r in kv_budget(cfg, FREE, tp=tp, page_size=page_size, model=label).rows}


def test_known_configs_parse_with_the_published_shapes() -> None:
    cfgs = {name: ModelConfig.from_dict(known_config(name)) for name in KNOWN_CONFIGS}
    kimi, ds, glm5, glm46 = cfgs["kimi-k2.6"], cfgs["deepseek-v3"], cfgs["glm-5"], cfgs["glm-4.6"]
    assert (kimi.num_layers, kimi.num_heads, kimi.kv_lora_rank, kimi.qk_rope_head_dim, kimi.num_experts) == \
        (61, 64, 512, 64, 384)
    assert kimi.checkpoint_prefix == "language_model." and kimi.eos_token_ids == (163586,)
    assert kimi.mla_softmax_scale == pytest.approx(0.14468, abs=1e-5)  # YaRN factor 64
    assert ds.num_heads == 128 and ds.mla_softmax_scale == pytest.approx(0.13523, abs=1e-5)  # factor 40
    assert (glm5.num_layers, glm5.v_head_dim, glm5.index_head_dim, glm5.index_topk) == (78, 256, 128, 2048)
    assert glm5.indexer_types == ("full",) * 78
    assert not glm46.is_mla and (glm46.num_layers, glm46.num_kv_heads, glm46.head_dim) == (92, 8, 128)
    assert known_config("KIMI-K2.6") == KNOWN_CONFIGS["kimi-k2.6"]
    assert known_config("glm-5") is not KNOWN_CONFIGS["glm-5"]  # a copy: callers cannot edit the table


def test_kimi_k26_bf16_is_70272_bytes_and_715k_tokens_in_46_8_gib_at_tp8() -> None:
    rows = _rows("kimi-k2.6")
    bf16, fp8, per_tensor = rows["bf16"], rows["fp8_e4m3"], rows[PER_TENSOR_FP8]
    assert bf16.bytes_per_token == 61 * 576 * 2 == 70_272
    assert bf16.tokens == 715_088 and bf16.tokens % 16 == 0  # 44,693 pages of 16
    # vLLM's log: 715,072 tokens = 11,173 FlashMLA blocks of 64
    assert _rows("kimi-k2.6", page_size=64)["bf16"].tokens == 715_072
    assert fp8.bytes_per_token == 656 * 61 == 40_016 and fp8.tokens == 1_255_760
    assert fp8.vs_bf16 == pytest.approx(70_272 / 40_016) and round(fp8.vs_bf16, 3) == 1.756
    assert per_tensor.bytes_per_token == 35_136 and per_tensor.vs_bf16 == 2.0
    assert rows["fp32"].bytes_per_token == 140_544
    # latent rows are replicated: the TP degree does not change them
    assert _rows("kimi-k2.6", tp=1)["bf16"].bytes_per_token == 70_272


def test_glm5_adds_the_fp8_indexer_cache_to_every_format() -> None:
    rows = _rows("glm-5")
    assert rows["bf16"].kv_bytes == 89_856 and rows["fp8_e4m3"].kv_bytes == 51_168
    assert rows[PER_TENSOR_FP8].kv_bytes == 44_928
    assert {r.indexer_bytes for r in rows.values()} == {10_296}  # 132 B x 78 layers
    assert rows["fp8_e4m3"].bytes_per_token == 61_464
    assert rows["fp8_e4m3"].vs_bf16 == pytest.approx((89_856 + 10_296) / 61_464)


def test_every_layer_keeps_indexer_keys_as_the_runtime_cache_allocates_them() -> None:
    raw = known_config("glm-5")
    raw["index_topk_pattern"] = "F" + "S" * 77
    cfg = ModelConfig.from_dict(raw)
    assert cfg.indexer_types[1] == "shared"
    assert {r.indexer_bytes for r in kv_budget(cfg, FREE).rows} == {10_296}
    raw.pop("index_topk_pattern")
    raw["num_hidden_layers"] = 10
    assert {r.indexer_bytes for r in kv_budget(ModelConfig.from_dict(raw), FREE).rows} == {1_320}


def test_glm46_gqa_splits_kv_heads_over_ranks_and_replicates_below_one_per_rank() -> None:
    tp8 = _rows("glm-4.6", tp=8)
    assert tp8["bf16"].bytes_per_token == 47_104 and tp8["bf16"].kv_bytes == 92 * 2 * 128 * 2
    assert tp8["fp8_e4m3"].bytes_per_token == 92 * 2 * 129 == 23_736  # head_dim + one scale byte
    assert _rows("glm-4.6", tp=1)["bf16"].bytes_per_token == 376_832
    assert _rows("glm-4.6", tp=4)["bf16"].bytes_per_token == 2 * 47_104
    assert _rows("glm-4.6", tp=16)["bf16"].bytes_per_token == 47_104  # 8 heads on 16 ranks: one replica each
    assert gqa_kv_heads_per_gpu(8, 2) == 4
    with pytest.raises(InvalidRequest):
        gqa_kv_heads_per_gpu(8, 3)
    with pytest.raises(InvalidRequest):
        gqa_kv_heads_per_gpu(3, 4)


def test_tokens_are_whole_pages_of_the_free_bytes() -> None:
    _, cfg = load_model_config("deepseek-v3")
    for free, page in ((10 * GIB + 12_345, 16), (3 * GIB, 7), (70_272 * 16, 16)):
        for row in kv_budget(cfg, free, page_size=page).rows:
            assert row.pages == free // (page * row.bytes_per_token) and row.tokens == row.pages * page
    with pytest.raises(InvalidRequest):
        kv_budget(cfg, FREE, tp=0)


def test_latent_row_bytes_are_the_bytes_of_a_stored_row() -> None:
    from kernels.latent_kv_store import quantize_latent_ref

    for r, dr in ((512, 64), (200, 16)):
        latent, k_pe = torch.randn(3, r) * 5, torch.randn(3, dr)
        for fmt in ("fp32", "bf16", "fp8_e4m3"):
            rows = quantize_latent_ref(latent, k_pe, fmt)
            assert latent_row_bytes(r, dr, fmt) == rows.shape[-1] * rows.element_size()
    assert latent_row_bytes(512, 64, PER_TENSOR_FP8) == 576


def test_a_latent_width_fp8_cannot_store_has_no_fp8_row() -> None:
    raw = known_config("deepseek-v3")
    raw["kv_lora_rank"] = 30
    rows = {r.kv_format for r in kv_budget(ModelConfig.from_dict(raw), FREE).rows}
    assert rows == {"fp32", "bf16", PER_TENSOR_FP8}


def test_latent_row_bytes_follows_the_layout() -> None:
    assert latent_row_bytes(512, 64, "fp8_e4m3") == 512 + 16 + 128
    assert latent_row_bytes(200, 16, "fp8_e4m3") == 200 + 4 * 2 + 32  # two groups: 128 + 72
    assert latent_row_bytes(32, 8, "bf16") == 80 and latent_row_bytes(32, 8, "fp32") == 160
    with pytest.raises(InvalidRequest):
        latent_row_bytes(30, 8, "fp8_e4m3")
    with pytest.raises(InvalidRequest):
        latent_row_bytes(32, 8, "int4")


def test_a_config_path_or_folder_gives_the_same_report_and_json(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "Kimi-K2.6"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(KNOWN_CONFIGS["kimi-k2.6"]))
    out_json = tmp_path / "out" / "budget.json"
    assert main(["kv-budget", str(folder / "config.json"), "--json", str(out_json)]) == 0
    by_path = capsys.readouterr().out
    assert main(["kv-budget", str(folder)]) == 0
    assert "70,272" in by_path and "715,088" in by_path and "1,255,760" in by_path and "1.756" in by_path
    assert "Kimi-K2.6" in capsys.readouterr().out
    report = json.loads(out_json.read_text())
    assert report["tokens"]["bf16"] == 715_088 and report["tp"] == 8 and report["attention"] == "MLA"
    assert report["free_gib"] == pytest.approx(46.8)
    assert {r["kv_format"] for r in report["rows"]} == {"fp32", "bf16", "fp8_e4m3", PER_TENSOR_FP8}


def test_bad_input_is_one_clear_line_and_a_nonzero_exit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["kv-budget", "kimi-k9"]) == 2
    err = capsys.readouterr().err
    assert "ModelNotFound" in err and "kimi-k2.6" in err and "Traceback" not in err
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    assert main(["kv-budget", str(bad)]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    assert main(["kv-budget", str(tmp_path / "missing.json")]) == 2
    assert "no such config file" in capsys.readouterr().err
    bad.write_text(json.dumps({"architectures": ["BertModel"]}))
    assert main(["kv-budget", str(bad)]) == 2
    assert "unsupported architecture" in capsys.readouterr().err
    assert main(["kv-budget", "glm-4.6", "--tp", "3"]) == 2
    assert main(["kv-budget", "glm-5", "--free-gib", "0"]) == 2
    with pytest.raises(ModelNotFound):
        load_model_config("nope")
    with pytest.raises(ModelLoadError):
        load_model_config(tmp_path / "absent")
