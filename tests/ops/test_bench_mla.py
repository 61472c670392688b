"""`edgeserve bench mla`: targets, the random checkpoint, and a tiny --quick run's JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ops.bench import mla as bench_mla

TINY = ["--quick", "--layers", "1", "--hidden", "64", "--heads", "2", "--kv-lora-rank", "32", "--experts", "4",
        "--vocab", "256", "--concurrency", "1,3", "--prompt-tokens", "8", "--bf16-requests", "2"]


def test_targets_need_1_7x_admitted_and_absorbed_faster_from_c8() -> None:
    decode = {"absorbed": {"1": 9.0, "8": 40.0, "32": 90.0}, "non_absorbed": {"1": 10.0, "8": 20.0, "32": 30.0}}
    ratios, met = bench_mla.targets({"bf16": 8, "fp8_e4m3": 14}, decode)
    assert ratios["admitted_fp8_vs_bf16"] == pytest.approx(1.75)
    assert ratios["absorbed_vs_non_absorbed"] == pytest.approx({"1": 0.9, "8": 2.0, "32": 3.0})
    assert met == {"admitted_fp8_vs_bf16_ge_1.7x": True, "absorbed_wins_from_c8": True}  # c = 1 may lose
    decode["absorbed"]["32"] = 29.0
    _, met = bench_mla.targets({"bf16": 8, "fp8_e4m3": 13}, decode)
    assert met == {"admitted_fp8_vs_bf16_ge_1.7x": False, "absorbed_wins_from_c8": False}


def test_random_checkpoint_is_a_deepseek_v3_our_config_reads(tmp_path: Path) -> None:
    from backend.config import load_config

    kwargs = bench_mla.model_config(hidden=64, layers=2, heads=2, experts=4, vocab=128, kv_lora_rank=32)
    bench_mla.write_random_deepseek_v3(tmp_path, kwargs, seed=1)
    cfg = load_config(tmp_path)
    assert cfg.architecture == "DeepseekV3ForCausalLM" and cfg.is_mla
    assert (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.num_layers, cfg.num_experts) == (32, 64, 2, 4)
    assert cfg.first_k_dense_replace == 1 and cfg.q_lora_rank == 256
    assert any(p.suffix == ".safetensors" for p in tmp_path.iterdir())


def test_quick_run_writes_every_figure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "mla.json"
    assert bench_mla.main([*TINY, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    # R 32, Dr 64, one layer: (32 + 64) * 4 / * 2, and 32 e4m3 + one fp32 scale + 64 bf16
    assert report["kv_bytes_per_token"] == {"fp32": 384, "bf16": 192, "fp8_e4m3": 164}
    assert set(report["admitted"]) == {"bf16", "fp8_e4m3"}
    assert report["admitted"] == report["admitted_by_pages"] and report["admitted"]["bf16"] == 2
    assert set(report["decode_tok_s"]) == {"absorbed", "non_absorbed"}
    for row in report["decode_tok_s"].values():
        assert set(row) == {"1", "3"} and all(v > 0 for v in row.values())
    assert set(report["ratios"]["absorbed_vs_non_absorbed_rounds"]) == {"1", "3"}
    assert set(report["kv_budget"]) == {"kimi-k2.6", "glm-5"}
    assert report["kv_budget"]["kimi-k2.6"]["bf16"] == 715_088
    assert report["kv_budget"]["glm-5"]["fp8_e4m3"] == 46.8 * 2**30 // (16 * 61_464) * 16
    assert report["commit"] and report["command"].startswith("edgeserve") and report["machine"]["cpu_count"]
    table = capsys.readouterr().out
    assert "absorbed/non" in table and "715,088" in table and "targets:" in table
