"""Every benchmark JSON records what it measured: the commit (and dirty flag), the command, the machine."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from ops.bench import write_report

ROOT = Path(__file__).resolve().parents[2]


def test_a_bare_report_gains_provenance_and_machine(tmp_path: Path) -> None:
    path = write_report(str(tmp_path / "sub" / "r.json"), {"tok_s": {"1": 2.0}})
    report = json.loads(path.read_text())
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert report["tok_s"] == {"1": 2.0}
    assert report["provenance"]["commit"] == head and isinstance(report["provenance"]["dirty"], bool)
    assert report["machine"]["cpu_count"] >= 1 and isinstance(report["machine"]["cpu_flags"], list)


def test_what_a_benchmark_recorded_itself_is_kept(tmp_path: Path) -> None:
    mine = {"commit": "abc", "machine": {"cpu_model": "x"}}
    report = json.loads(write_report(str(tmp_path / "r.json"), mine).read_text())
    assert report == mine
