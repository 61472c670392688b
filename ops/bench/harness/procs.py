"""The benchmarks' child processes, beyond starting them (`ops.cluster.child_process`, `Service`,
`wait_http`): what CPU they used, stopping a whole process group, what their logs say, and
waiting until workers have registered in Redis.

CPU time comes from /proc/PID/stat (utime + stime, every thread), so it counts only the
process's own work whatever else the shared machine runs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path

__all__ = ["process_cpu_s", "cpu_seconds", "busy_cpus", "descendants", "named_descendants", "stop_group", "log_lines",
           "wait_registered"]


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` (all its threads) so far; raises OSError when it is gone."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)


def cpu_seconds(pids: Iterable[int]) -> float:
    """User + system CPU seconds of these processes (those already gone count 0)."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            total += process_cpu_s(pid)
    return total


def _cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat's `cpu` line (idle and iowait are idle)."""
    values = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    return sum(values) - idle, sum(values)


def busy_cpus(window_s: float = 2.0) -> float:
    """How many CPUs were busy, on average, over the next `window_s` seconds (every process on the machine;
    the caller sleeps meanwhile). Unlike the load average, it says nothing of the last minute, so a
    benchmark that just finished does not count as other work."""
    busy0, total0 = _cpu_ticks()
    time.sleep(window_s)
    busy1, total1 = _cpu_ticks()
    cpus = os.cpu_count() or 1
    return cpus * (busy1 - busy0) / max(1, total1 - total0)


def wait_idle(busy_below: float = 0.25, window_s: float = 1.0, max_wait_s: float = 30.0) -> tuple[float, float]:
    """Wait until fewer than `busy_below` CPUs were busy over a `window_s` window (`busy_cpus`: every process
    on the machine), at most about `max_wait_s`. Returns (the last window's busy CPUs, seconds waited)."""
    started = time.monotonic()
    while True:
        busy = busy_cpus(window_s)
        waited = time.monotonic() - started
        if busy < busy_below or waited >= max_wait_s:
            return busy, waited


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def named_descendants(name: str, pid: int | None = None) -> list[int]:
    """The processes below `pid` (default: this one) whose command name is `name` (e.g. "redis-server")."""
    out = []
    for p in descendants(os.getpid() if pid is None else pid):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{p}/comm").read_text().strip() == name:
                out.append(p)
    return out


def stop_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """End whatever is left of `proc`'s process group (a benchmark and the workers, gateways and Redis it
    started): SIGTERM, then SIGKILL after `grace_s`. Nothing to do when the group is already gone."""
    deadline = time.monotonic() + grace_s
    sig = signal.SIGTERM
    while True:
        try:
            os.killpg(proc.pid, sig if sig else 0)
        except ProcessLookupError:
            break
        proc.poll()  # reap the leader, or the group never empties
        sig = None
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.1)
    proc.poll()


def log_lines(logs: Path, matches: Callable[[str], bool]) -> dict[str, list[str]]:
    """Per log in `logs` (``*.log``, by name without the suffix, every log listed): its lines that `matches`."""
    return {path.stem: [line for line in path.read_text(errors="replace").splitlines() if matches(line)]
            for path in sorted(logs.glob("*.log"))}


def wait_registered(redis_url: str, model: str, worker_ids: list[str], timeout_s: float = 30.0,
                    logs: dict[str, Path] | None = None) -> None:
    """Wait until every worker of `worker_ids` has its registry record for `model` in Redis; raise
    `BackendUnavailable` after `timeout_s`, naming the workers still missing and, with `logs` (worker id ->
    its log), ending with each missing one's log tail."""
    import redis

    from backend.errors import BackendUnavailable
    from backend.registration import record_key
    from ops.cluster import log_tail

    client = redis.Redis.from_url(redis_url, socket_timeout=2)
    deadline = time.monotonic() + timeout_s
    missing = list(worker_ids)
    try:
        while time.monotonic() < deadline:
            missing = [i for i in worker_ids if not client.exists(record_key(model, i))]
            if not missing:
                return
            time.sleep(0.2)
    finally:
        client.close()
    tails = "".join(f"\n--- {i}'s log ends:\n{log_tail(logs[i])}" for i in missing if logs and i in logs)
    raise BackendUnavailable(f"workers {missing} of {worker_ids} did not register in {timeout_s:.0f} s{tails}")
