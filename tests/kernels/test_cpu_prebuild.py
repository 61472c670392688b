"""The workers' prebuild of the CPU kernels (`kernels/cpu_prebuild.py`): it finds every C source, and in a
fresh process it leaves each kernel loaded (or failed with its reason) before anything calls one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kernels.cpu_prebuild import cpu_kernels

ROOT = Path(__file__).resolve().parents[2]


def test_every_c_source_is_prebuilt() -> None:
    found = [k.source.name for k in cpu_kernels()]
    assert len(found) == len(set(found))  # each source once (modules that share a kernel list it once)
    assert set(found) == {p.name for p in (ROOT / "kernels" / "cpu").glob("*.c")}
    sizes = [(ROOT / "kernels" / "cpu" / name).stat().st_size for name in found]
    assert sizes == sorted(sizes, reverse=True)  # the longest build starts first


def test_prebuild_loads_every_kernel_before_any_call() -> None:
    script = """
import json
from kernels.cpu_prebuild import start_prebuild
p = start_prebuild(workers=2)  # nothing in this process calls a kernel
took = p.wait()
print(json.dumps({"n": len(p.kernels), "loaded": sum(k._lib is not None for k in p.kernels),
                  "failed": p.failed(), "took": took, "done": p.done()}))
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.splitlines()[-1])
    assert got["done"] and got["took"] >= 0
    assert got["loaded"] + len(got["failed"]) == got["n"]  # each one resolved: loaded, or failed with its reason
    assert got["loaded"] > 0
