"""`edgeserve bench structured --quick` end to end on the tiny chat model: the JSON keys the issue names."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ops.bench.harness.stats import throughput_overhead, verdict
from ops.cli import main


def test_quick_run_writes_the_report(tiny_chat_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "structured.json"
    # --ci-width 0: no interval is that narrow, so every level runs to --max-repeats
    assert main(["bench", "structured", "--quick", "--model", str(tiny_chat_dir), "--concurrency", "1,2",
                 "--repeats", "2", "--max-repeats", "4", "--ci-width", "0", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["tok_s"]) == {"free", "json_schema"} and set(report["tok_s"]["free"]) == {"1", "2"}
    assert all(v > 0 for by_c in report["tok_s"].values() for v in by_c.values())
    assert report["compile_ms_p50"] > 0 and report["mask_us_mean"] > 0
    assert report["valid_rate"] == 1.0 or report["finished"] == 0
    per_c = report["overhead"]  # over decode steps paired across the two engines, each repetition's too
    assert set(per_c) == {"1", "2"} and (report["rounds"], report["max_rounds"]) == (2, 4)
    for c, v in per_c.items():
        assert v["repeats"] == len(v["per_repeat"]) == 4 and v["pairs"] > 0 and v["advance_share_pct"] > 0
        assert v["ci95"][0] <= v["ci95"][1] and v["pct"] == report["overhead_pct"][c]
    assert report["targets"]["overhead_lt_10pct"]["verdict"] in ("met", "missed", "unresolved")


def test_a_level_stops_repeating_once_its_interval_is_narrow(tiny_chat_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "structured.json"  # any interval is under 1000 points wide: the minimum, 2, is enough
    assert main(["bench", "structured", "--quick", "--model", str(tiny_chat_dir), "--concurrency", "1",
                 "--repeats", "2", "--ci-width", "1000", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["max_rounds"] == 12 and report["overhead"]["1"]["repeats"] == 2


def test_overhead_and_verdict_at_the_structured_limit() -> None:
    free = np.array([0.10, 0.20, 0.10])
    assert throughput_overhead(free * 1.25, free) == pytest.approx(20.0)  # 1 - 1/1.25
    assert throughput_overhead(free, free) == 0.0
    assert [verdict(ci, 10.0) for ci in ([2.0, 9.9], [10.5, 12.0], [8.0, 11.0])] == ["met", "missed", "unresolved"]
