"""The state of this shared machine around a run: load average, memory available, uptime.

Other people's processes share these cores, so a benchmark records how loaded the machine
was before and after (and refuses, or waits, when too little memory is free to start its
workers without the kernel's OOM killer picking a process). CPU model and flags are
`ops.cluster.machine_info`'s.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

__all__ = ["load_average", "load_average_text", "mem_available_gib", "uptime"]


def load_average(ndigits: int | None = None) -> list[float]:
    """The 1, 5 and 15 minute load averages (rounded to `ndigits` when given)."""
    values = list(os.getloadavg())
    return values if ndigits is None else [round(x, ndigits) for x in values]


def load_average_text() -> list[str]:
    """The 1, 5 and 15 minute load averages as /proc/loadavg writes them."""
    with open("/proc/loadavg") as f:
        return f.read().split()[:3]


def mem_available_gib(ndigits: int | None = None) -> float:
    """MemAvailable of /proc/meminfo in GiB (rounded to `ndigits` when given); NaN when unreadable."""
    with contextlib.suppress(OSError, IndexError, ValueError):
        gib = int(Path("/proc/meminfo").read_text().split("MemAvailable:")[1].split()[0]) / 2**20
        return gib if ndigits is None else round(gib, ndigits)
    return float("nan")


def uptime() -> str:
    """`uptime`'s line (time up, users, load), or "" when it cannot run."""
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        return subprocess.run(["uptime"], check=True, capture_output=True, text=True).stdout.strip()
    return ""
