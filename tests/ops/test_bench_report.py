"""Every benchmark JSON records what it measured: the commit (and dirty flag), the command, the machine."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from ops.bench.report import write_report

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


def test_the_commit_is_taken_when_the_run_starts(tmp_path: Path, monkeypatch) -> None:
    """A commit landing during a long run is not recorded as the code that ran: the report keeps the
    start's commit and names the end's beside it."""
    import argparse

    from ops.bench import report

    moves = iter([{"commit": "before", "dirty": False, "command": "edgeserve bench x"},
                  {"commit": "after", "dirty": False, "command": "edgeserve bench x"}])
    monkeypatch.setattr(report, "provenance", lambda: next(moves))
    monkeypatch.setattr(report, "_started", None)  # restored to None after the test

    def run(args: argparse.Namespace) -> int:
        write_report(str(tmp_path / "r.json"), {"tok_s": {}})
        return 0

    assert report.recording_start(run)(argparse.Namespace()) == 0
    got = json.loads((tmp_path / "r.json").read_text())["provenance"]
    assert got["commit"] == "before" and got["at_end"] == {"commit": "after", "dirty": False}
