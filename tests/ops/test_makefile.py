"""The Makefile's two commands, dry-run on a fresh checkout: what each installs, and the PyTorch build choice."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def dry_run(tmp_path: Path, *args: str) -> str:
    """`make -n ARGS` in a copy of the project's build files with no .venv (a fresh clone)."""
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}  # not a sub-make
    done = subprocess.run(["make", "--no-print-directory", "-n", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_serve_installs_the_runtime_only_and_says_so(tmp_path: Path) -> None:
    out = dry_run(tmp_path, "serve")
    assert "install" in out and "-e ." in out and ".[test]" not in out, out
    assert "echo \"edgeserve: installing PyTorch" in out, out  # each step is announced
    assert out.index("torch==2.13.0") < out.index("-e ."), out  # the pinned torch goes in first
    assert out.rstrip().endswith(".venv/bin/edgeserve up"), out


def test_test_installs_the_test_extras(tmp_path: Path) -> None:
    out = dry_run(tmp_path, "test")
    assert "-e '.[test]'" in out and "pytest" in out, out


def test_torch_index_url_chooses_the_build(tmp_path: Path) -> None:
    out = dry_run(tmp_path, "serve", "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu")
    torch_line = next(line for line in out.splitlines() if "pip" in line and "torch==2.13.0" in line)
    assert "--index-url https://download.pytorch.org/whl/cpu" in torch_line, out
    assert "--index-url" not in dry_run(tmp_path, "serve"), "no index is forced by default"
