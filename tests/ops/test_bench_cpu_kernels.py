"""`edgeserve bench cpu-kernels`: the alternating timer, and a run on a tiny model's shapes."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pytest

from ops.bench import cpu_kernels


def test_alternate_times_each_call_by_its_median_and_rotates_who_goes_first() -> None:
    order: list[str] = []

    def sleeper(name: str, seconds: float):
        def call() -> None:
            order.append(name)
            time.sleep(seconds)
        return call

    runs = cpu_kernels.alternate({"short": sleeper("short", 0.002), "long": sleeper("long", 0.012)}, reps=4,
                                 settle_s=0.0)
    assert len(runs["short"]) == len(runs["long"]) == 4
    assert all(0.002 <= t < 0.010 for t in runs["short"]) and all(t >= 0.012 for t in runs["long"])
    assert order[:2] == ["short", "long"]  # the untimed round
    assert order[2:] == ["short", "long", "long", "short", "short", "long", "long", "short"]


def test_a_run_on_a_tiny_model_times_every_kernel_that_builds(tiny_chat_dir: Path, tmp_path: Path) -> None:
    from kernels import cpu_gemv, cpu_gemv_f32, cpu_gemv_int4, cpu_paged_attention, cpu_rms_norm

    out = tmp_path / "ck.json"
    p = argparse.ArgumentParser()
    cpu_kernels.add_arguments(p)
    args = p.parse_args(["--model", str(tiny_chat_dir), "--rows", "1,3", "--reps", "1", "--context", "40",
                         "--attention-rows", "2", "--prompt-rows", "20"])
    args.quick, args.json_path = True, str(out)
    assert cpu_kernels.run(args) == 0
    report = json.loads(out.read_text())
    rows = report["results"]
    by_section: dict[str, list[dict]] = {}
    for r in rows:
        by_section.setdefault(r["section"], []).append(r)
        assert r["c_ms"] > 0 and r["torch_ms"] > 0
        assert r["torch_over_c"] == pytest.approx(r["torch_ms"] / r["c_ms"])
        lo, hi = r["torch_over_c_rounds"]  # one round, so its own ratio is the ratio of medians
        assert lo == hi == pytest.approx(r["torch_over_c"]) and len(r["c_ms_runs"]) == 1
        assert report["headline"][f"torch_over_c.{r['key']}"] == pytest.approx(r["torch_over_c"], abs=1e-3)
    # a section runs where its kernels build, and is reported as unavailable where they do not
    for section, module in [("linear", cpu_gemv), ("linear_f32", cpu_gemv_f32), ("int4", cpu_gemv_int4),
                            ("attention", cpu_paged_attention),
                            ("prompt", cpu_paged_attention), ("rows", cpu_rms_norm)]:
        assert (section in by_section) == module.available()
        assert (section in report["unavailable"]) == (not module.available())
    if "linear" in by_section:
        assert [r["rows"] for r in by_section["linear"]] == [1, 3]
        r = by_section["linear"][0]
        bound = report["bench_machine"]["bound_gemm_gflop_s"]
        assert r["pct_of_gemm_bound"] == pytest.approx(100 * r["c_rate"] / bound)
    if "linear_f32" in by_section:  # float32 weights: twice the bytes of the bfloat16 pass over the same shapes
        assert [(r["rows"], r["kernel"]) for r in by_section["linear_f32"]] == [(1, "gemv_f32"), (3, "gemv_f32")]
        if "linear" in by_section:
            assert by_section["linear_f32"][0]["weight_bytes"] == 2 * by_section["linear"][0]["weight_bytes"]
    if "attention" in by_section:
        assert [r["format"] for r in by_section["attention"]] == ["bf16", "fp8_e4m3"]
    if "prompt" in by_section:  # a fresh chunk and one after the context's keys, each page format
        assert [(r["format"], r["prefix"], r["rows"]) for r in by_section["prompt"]] == [
            ("bf16", 0, 20), ("fp8_e4m3", 0, 20), ("bf16", 40, 20), ("fp8_e4m3", 40, 20)]
        # over fp8 pages the engine's way (dequantised first, where the kernel can) beside the pages read in place
        cfg = json.loads((tiny_chat_dir / "config.json").read_text())
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        deq = cpu_paged_attention.dequantises(head_dim)
        for r in by_section["prompt"]:
            assert ("in_place_ms" in r) == (deq and r["format"] == "fp8_e4m3")
            if "in_place_ms" in r:
                assert r["in_place_over_c"] == pytest.approx(r["in_place_ms"] / r["c_ms"])
    if "rows" in by_section:  # one row and the most rows asked for
        assert sorted({r["rows"] for r in by_section["rows"]}) == [1, 3]
    assert report["provenance"]["commit"]


def test_bench_kernels_on_a_host_without_cuda_runs_what_it_can_and_says_what_it_skipped(tmp_path: Path) -> None:
    import torch

    from ops.bench import kernels

    if torch.cuda.is_available():
        pytest.skip("a CUDA host runs every part")
    p = argparse.ArgumentParser()
    kernels.add_arguments(p)
    args = p.parse_args([])
    args.quick, args.json_path = True, str(tmp_path / "k.json")
    assert kernels.run(args) == 0
    report = json.loads((tmp_path / "k.json").read_text())
    assert report["skipped"] == {"attention": "no CUDA device", "moe": "no CUDA device"}
    assert report["mla_decode"]["results"]  # the torch reference ran
    args.parts = "attention"  # asked for by name: a failure, not a skip
    assert kernels.run(args) == 1
