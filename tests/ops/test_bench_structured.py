"""`edgeserve bench structured --quick` end to end on the tiny chat model: the JSON keys the issue names."""

from __future__ import annotations

import json
from pathlib import Path

from ops.cli import main


def test_quick_run_writes_the_report(tiny_chat_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "structured.json"
    assert main(["bench", "structured", "--quick", "--model", str(tiny_chat_dir), "--concurrency", "1,2",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["tok_s"]) == {"free", "json_schema"} and set(report["tok_s"]["free"]) == {"1", "2"}
    assert all(v > 0 for by_c in report["tok_s"].values() for v in by_c.values())
    assert report["compile_ms_p50"] > 0 and report["mask_us_mean"] > 0
    assert report["valid_rate"] == 1.0 or report["finished"] == 0
