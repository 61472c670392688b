"""`edgeserve bench fairness` on SmolLM2, a short run: its arms, figures and ratios."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from ops.bench.fairness import ARMS, run


def test_bench_fairness_quick_report(smollm2_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "fairness.json"
    args = argparse.Namespace(model=str(smollm2_dir), dtype="auto", kv_format="auto", flood=10, light=2,
                              light_start_ms=0.0, light_gap_ms=5.0, prompt_tokens=64, output_tokens=2, rounds=2,
                              seed=0, quick=True, json_path=str(out))
    assert run(args) == 0
    report = json.loads(out.read_text())
    assert report["workload"]["flood"] == 10 and report["rounds"] == 2
    for arm in ARMS:
        assert len(report["results"][arm]) == 2
        for r in report["results"][arm]:
            assert len(r["light_ttft_s"]) == 2 and r["light_ttft_max_s"] == max(r["light_ttft_s"]) > 0
            assert 0 < r["flood_ttft_p50_s"] <= r["flood_makespan_s"] <= r["total_s"]
            assert r["output_tok_s"] == pytest.approx(12 * 2 / r["total_s"])
    ratio = report["ratios"]["light_ttft_p50_fifo_over_fair"]
    pairs = [f["light_ttft_p50_s"] / g["light_ttft_p50_s"] for f, g in zip(report["results"]["fifo"],
                                                                          report["results"]["fair"])]
    assert ratio["median"] == pytest.approx(sum(pairs) / 2) and min(pairs) <= ratio["ci95"][0] <= max(pairs)
    assert set(report["headline"]) == set(report["ratios"]) and report["provenance"]["commit"]
