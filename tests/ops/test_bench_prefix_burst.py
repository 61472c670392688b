"""`edgeserve bench prefix-burst` on SmolLM2, a short run: a burst's shared prefix is computed once when waiting."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ops.bench.prefix_burst import ARMS, run


def test_bench_prefix_burst_quick_report(smollm2_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "burst.json"
    args = argparse.Namespace(model=str(smollm2_dir), dtype="auto", kv_format="auto", prefix_tokens=64,
                              own_tokens=8, bursts="2:0,3:5", rounds=2, seed=0, quick=True, json_path=str(out))
    assert run(args) == 0
    report = json.loads(out.read_text())
    assert report["workloads"] == ["2:0", "3:5"]
    together = report["bursts"]["2:0"]
    for burst in together["wait"]:  # the first computes 64 + 8 tokens, the second only its own 8
        assert burst["computed_tokens"] == 64 + 2 * 8 and burst["cached_tokens"] == 64
    for burst in together["side_by_side"]:  # both admitted in one step: the prefix computed twice
        assert burst["computed_tokens"] == 2 * (64 + 8) and burst["cached_tokens"] == 0
    for arm in ARMS:
        for burst in report["bursts"]["3:5"][arm]:
            assert len(burst["ttft_s"]) == 3 and burst["makespan_s"] >= max(burst["ttft_s"]) > 0
    ratio = report["summary"]["2:0"]["ttft_p50_side_by_side_over_wait"]
    pairs = [s["ttft_p50_s"] / w["ttft_p50_s"] for s, w in zip(together["side_by_side"], together["wait"])]
    assert min(pairs) <= ratio["median"] <= max(pairs) and ratio["ci95"][0] <= ratio["ci95"][1]
    assert set(report["headline"]) == {f"{m}.{w}" for m in ("ttft_p50_x", "makespan_x") for w in ("2:0", "3:5")}
    assert report["provenance"]["commit"]
