"""`edgeserve bench moe`: ratios and targets, the printed table, the random checkpoint, and a tiny run."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from ops import bench
from ops.bench import moe as bench_moe
from ops.bench.harness.prompts import random_prompts
from ops.cli import main

TINY = ["--hidden", "128", "--inter", "128", "--experts", "8", "--top-k", "2", "--vocab", "512", "--layers", "2",
        "--layer-tokens", "1,32", "--concurrency", "1,2", "--prompt-tokens", "12", "--prefill-tokens", "24"]


def _figures(grouped: float | None = 10.0) -> tuple[dict, dict]:
    layer = {"loop": {"1": 2.0, "32": 20.0}, "int4_loop": {"1": 1.0, "32": 8.0}, "transformers": {"1": 3.0, "32": 9.5}}
    if grouped is not None:
        layer = {"grouped": {"1": 2.5, "32": grouped}, "int4_grouped": {"1": 0.5, "32": 5.0}, **layer}
    decode = {"fp32": {"1": 20.0, "8": 40.0}, "bf16": {"1": 26.0, "8": 60.0}, "int4": {"1": 31.0, "8": 100.0}}
    return layer, decode


def test_ratios_are_speedups_and_targets_compare_them_to_the_bounds() -> None:
    ratios, targets = bench_moe.ratios_and_targets(*_figures(grouped=10.0))
    assert ratios == pytest.approx({"grouped_vs_loop_32": 2.0, "grouped_vs_transformers_32": 0.95,
                                    "int4_loop_vs_loop_32": 2.5, "int4_grouped_vs_int4_loop_32": 1.6,
                                    "int4_vs_fp32_decode_c1": 1.55,
                                    "bf16_vs_fp32_decode_c1": 1.3})
    assert targets == {"grouped_vs_loop_32_ge_2x": True, "grouped_vs_transformers_32_ge_1x": False,
                       "int4_vs_fp32_decode_c1_ge_1.5x": True}  # the bf16 engine's ratio has no target
    _, slower = bench_moe.ratios_and_targets(*_figures(grouped=10.5))
    assert slower["grouped_vs_loop_32_ge_2x"] is False


def test_a_missing_grouped_path_has_no_ratio_and_misses_its_targets() -> None:
    ratios, targets = bench_moe.ratios_and_targets(*_figures(grouped=None))
    assert ratios["grouped_vs_loop_32"] is None and ratios["grouped_vs_transformers_32"] is None
    assert ratios["int4_grouped_vs_int4_loop_32"] is None
    assert not targets["grouped_vs_loop_32_ge_2x"] and not targets["grouped_vs_transformers_32_ge_1x"]
    assert targets["int4_vs_fp32_decode_c1_ge_1.5x"]


def test_random_prompts_are_reproducible_ids_without_specials() -> None:
    a = random_prompts(50, 3, 40, seed=7)
    assert a == random_prompts(50, 3, 40, seed=7) != random_prompts(50, 3, 40, seed=8)
    assert [len(p) for p in a] == [40, 40, 40] and all(3 <= t < 50 for p in a for t in p)


def test_random_checkpoint_loads_in_transformers_with_every_tensor_written(tmp_path: Path) -> None:
    import transformers

    cfg = bench_moe.model_config(hidden=64, layers=3, experts=8, top_k=2, inter=32, vocab=256)
    bench_moe.write_random_glm4_moe(tmp_path, cfg, seed=3)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) == 4  # one shard per layer and one for the rest
    model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert type(model).__name__ == "Glm4MoeForCausalLM" and not info["missing_keys"] and not info["unexpected_keys"]
    assert model.config.first_k_dense_replace == 1 and model.config.n_group == 1
    norm = model.model.layers[1].input_layernorm.weight
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    assert 0.5 < norm.mean() < 1.5 and norm.std() > 0.01 and 0 <= bias.min() and bias.max() < 0.01
    up = model.model.layers[2].mlp.experts.gate_up_proj  # [E, 2I, H]: std fan_in^-0.5
    assert float(up.detach().std()) == pytest.approx(64 ** -0.5, rel=0.1)


def test_registered_under_bench() -> None:
    parser = argparse.ArgumentParser()
    bench.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "moe", "--quick"])
    assert args.func.__wrapped__ is bench_moe.run and args.json_path == "bench-results/moe.json"
    assert (args.hidden, args.experts, args.top_k, args.inter, args.layers) == (1024, 64, 8, 512, None)


def test_tiny_run_writes_every_key_and_the_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "moe.json"
    threads = torch.get_num_threads()
    try:
        assert main(["bench", "moe", "--quick", "--json", str(out), *TINY]) == 0
    finally:
        torch.set_num_threads(threads)
    report = json.loads(out.read_text())
    grouped = {p for p in ("grouped", "int4_grouped") if p in report["moe_layer_ms"]}
    paths = {"loop", "int4_loop", "transformers"} | grouped
    assert set(report["moe_layer_ms"]) == paths
    assert all(set(row) == {"1", "32"} and all(v > 0 for v in row.values()) for row in report["moe_layer_ms"].values())
    assert set(report["decode_tok_s"]) == {"fp32", "bf16", "int4"}
    assert all(set(row) == {"1", "2"} and all(v > 0 for v in row.values()) for row in report["decode_tok_s"].values())
    assert set(report["prefill_tok_s"]) == {"fp32", "bf16", "int4"}
    assert all(v > 0 for v in report["prefill_tok_s"].values())
    assert {"commit", "dirty", "command", "machine", "ratios", "targets", "config"} <= set(report)
    assert "cpu_flags" in report["machine"] and report["config"]["model"]["num_hidden_layers"] == 2
    assert report["ratios"] == bench_moe.ratios_and_targets(report["moe_layer_ms"], report["decode_tok_s"])[0]
    assert max(report["weight_memory_bytes"]["int4"], report["weight_memory_bytes"]["bf16"]) \
        < report["weight_memory_bytes"]["fp32"]  # (fp32 with its MKL packs)
    assert report["resident_mb_after_load"]["anon"] > report["weight_memory_bytes"]["fp32"] / 2**20
    table = capsys.readouterr().out
    assert bench_moe.format_table(report) in table
    for target, met in report["targets"].items():
        assert f"{target} {'met' if met else 'MISSED'}" in table
