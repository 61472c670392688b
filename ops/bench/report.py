"""A benchmark's JSON report, and the provenance every report records: which commit ran (taken when the
run started, so a commit landing mid-run is not recorded as the code that ran), whether the tree was
dirty, the command line, and the machine."""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["write_report", "provenance", "recording_start"]

_started: dict[str, object] | None = None  # provenance() when the running benchmark started


def recording_start(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """`run` with the code's provenance taken before it starts: a commit landing during a long
    run must not be recorded as the code that ran."""

    @functools.wraps(run)
    def started(args: argparse.Namespace) -> int:
        global _started
        _started = provenance()
        return run(args)

    return started


def write_report(json_path: str, report: dict[str, Any]) -> Path:
    """Write a benchmark's JSON report (creating its folder) and say where. Every report records
    what it measured: `provenance()` (commit, dirty flag, command line) and the host's
    `machine_info()` (CPU model and flags) are added unless the benchmark set them itself."""
    from ops.cluster import machine_info

    if "provenance" not in report and "commit" not in report:
        report = {**report, "provenance": _run_provenance()}
    if "machine" not in report:
        report = {**report, "machine": machine_info()}
    path = Path(json_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")
    return path


def _run_provenance() -> dict[str, object]:
    """The provenance taken when the benchmark started (now, outside `edgeserve bench`), plus the
    commit at the end when it differs, so a report never hides that the tree moved mid-run."""
    if _started is None:
        return provenance()
    now = provenance()
    if (now["commit"], now["dirty"]) != (_started["commit"], _started["dirty"]):
        return {**_started, "at_end": {"commit": now["commit"], "dirty": now["dirty"]}}
    return dict(_started)


def provenance() -> dict[str, object]:
    """Which code ran and how: the git commit (None outside a checkout), whether the tree had
    uncommitted changes to tracked files, and the command line."""
    root = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"), "dirty": None if status is None else bool(status),
            "command": " ".join(["edgeserve", *sys.argv[1:]])}
