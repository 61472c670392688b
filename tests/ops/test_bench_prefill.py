"""`edgeserve bench prefill` on SmolLM2, a short run: its arms and figures, and the lengths it draws."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from ops.bench.prefill import ARMS, lengths, run


def test_lengths_are_distinct_in_range_and_never_a_multiple_of_the_granule() -> None:
    got = lengths(40, 130, 200, 16, seed=3)
    assert len(set(got)) == 40 and all(130 <= n < 200 and n % 16 for n in got)
    assert lengths(40, 130, 200, 16, seed=3) == got and lengths(40, 130, 200, 16, seed=4) != got
    with pytest.raises(ValueError):
        lengths(67, 130, 200, 16, seed=0)  # 70 lengths, 4 of them multiples of 16


def test_bench_prefill_quick_report(smollm2_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGESERVE_GEMM_ROW_GRANULE", "4")
    monkeypatch.delenv("EDGESERVE_KERNEL_OPENMP", raising=False)
    out = tmp_path / "prefill.json"
    args = argparse.Namespace(model=str(smollm2_dir), dtype="auto", kv_format="auto", prompts=2, min_tokens=130,
                              max_tokens=150, granule=16, seed=0, quick=True, json_path=str(out))
    assert run(args) == 0
    # the run puts back what it found
    assert os.environ["EDGESERVE_GEMM_ROW_GRANULE"] == "4" and "EDGESERVE_KERNEL_OPENMP" not in os.environ
    report = json.loads(out.read_text())
    assert report["lengths"] == lengths(2, 130, 150, 16, seed=0)
    for arm in ARMS:
        assert len(report["ttft_ms"][arm]) == 2 and all(t > 0 for t in report["ttft_ms"][arm])
    r = report["ratios"]["exact_over_default"]
    a, b = report["ttft_ms"]["exact"], report["ttft_ms"]["default"]
    assert r["median"] == pytest.approx((a[0] / b[0] + a[1] / b[1]) / 2)
    assert min(a[0] / b[0], a[1] / b[1]) <= r["ci95"][0] <= r["ci95"][1] <= max(a[0] / b[0], a[1] / b[1])
    assert set(report["headline"]) == {"exact_over_default", "exact_seen_over_default", "exact_over_exact_seen",
                                       "helper_pool_over_default", "plain_weights_over_default"}
    assert report["provenance"]["commit"]
