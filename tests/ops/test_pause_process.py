"""`pause_process` (what a hung Redis or Mooncake master is in tests and soak): when it returns, every thread of
the child is stopped, also threads that were spinning on a CPU; SIGCONT lets it go on."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from ops.redis_server import pause_process, stop_process

SPINNER = """
import threading, time
def spin():
    while True:
        pass
for _ in range(4):
    threading.Thread(target=spin, daemon=True).start()
print("ready", flush=True)
while True:
    time.sleep(0.001)
"""


def _states(pid: int) -> list[str]:
    return [(t / "stat").read_text().rpartition(")")[2].split()[0] for t in Path(f"/proc/{pid}/task").iterdir()]


def test_every_thread_is_stopped_when_it_returns_and_sigcont_resumes() -> None:
    proc = subprocess.Popen([sys.executable, "-c", SPINNER], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        for _ in range(20):
            pause_process(proc)
            states = _states(proc.pid)
            assert len(states) >= 5 and all(s in ("T", "t") for s in states), states
            proc.send_signal(signal.SIGCONT)
            deadline = time.monotonic() + 2
            while any(s in ("T", "t") for s in _states(proc.pid)):  # every thread leaves the stop
                assert time.monotonic() < deadline, _states(proc.pid)
                time.sleep(0.001)
    finally:
        proc.send_signal(signal.SIGCONT)
        stop_process(proc, timeout_s=2)
