"""Child processes of a local cluster, as the benchmarks run them: start, wait for, kill, restart.

    with child_process(argv, log_path) as proc:             # stopped (SIGTERM, then SIGKILL) on exit
        wait_http(url + "/health", proc, log_path, "worker u1", timeout_s=120)

    svc = Service("worker u1", argv, log_path)              # a process that a fault may kill and restart
    svc.start(); svc.kill(); svc.start(); svc.stop()

    with mooncake_master() as master:                      # "127.0.0.1:PORT" of a fresh mooncake_master
        ...                                                 # (`edgeserve up --kv-store`, tests)

Every child writes stdout and stderr to its own log file, which is appended to
across restarts (so a killed process's last words survive). `machine_info`
describes the host a benchmark ran on, for its JSON report.

`MooncakeMaster` is the KV store's master (`mooncake_master` from the Mooncake wheel:
the binary in the `mooncake` package folder, found without importing the library, else
the environment's `bin/` wrapper or PATH) on free loopback ports, with its metrics reporting off. It keeps only
metadata; the stored blocks live in the workers' own segments
(`backend/kv_store_client.py`), so stopping it loses the index of every block, never a
request. `kill` / `pause` / `resume` are the outage drills.
"""

from __future__ import annotations

import contextlib
import os
import platform
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ops.redis_server import pause_process, stop_process

__all__ = ["child_process", "wait_http", "wait_redis", "Service", "machine_info", "log_tail", "mooncake_master_binary",
           "MooncakeMaster", "mooncake_master", "kv_store_master"]


def log_tail(log_path: Path, chars: int = 1500) -> str:
    """The last `chars` characters of a child's log ("" when it has none)."""
    return log_path.read_text(errors="replace")[-chars:] if log_path.exists() else ""


def _popen(argv: list[str], log_path: Path, env: dict[str, str] | None) -> subprocess.Popen:
    with open(log_path, "ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})


@contextlib.contextmanager
def child_process(argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    """Run `argv` (environment = ours + `env`, output to `log_path`) until the context exits."""
    proc = _popen(argv, log_path, env)
    try:
        yield proc
    finally:
        stop_process(proc)


def wait_http(url: str, proc: subprocess.Popen, log_path: Path, what: str, timeout_s: float,
              headers: dict[str, str] | None = None) -> None:
    """Poll GET `url` until it answers 200; raise `BackendUnavailable` (with the log's tail) if `proc`
    exits first or `timeout_s` passes."""
    import httpx

    from backend.errors import BackendUnavailable

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2, headers=headers).status_code == 200:
                return
        time.sleep(0.2)
    state = f"exited with status {proc.returncode}" if proc.poll() is not None else f"not up in {timeout_s:.0f} s"
    raise BackendUnavailable(f"{what} {state}; its log ends:\n{log_tail(log_path)}")


def wait_redis(url: str, proc: subprocess.Popen, log_path: Path, timeout_s: float = 10.0) -> None:
    """Poll PING on `url` until Redis answers; raise `BackendUnavailable` if `proc` exits or time runs out."""
    import redis

    from backend.errors import BackendUnavailable

    client = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                if client.ping():
                    return
            time.sleep(0.05)
    finally:
        client.close()
    raise BackendUnavailable(f"redis-server at {url} did not answer in {timeout_s:.0f} s; its log ends:\n"
                             f"{log_tail(log_path)}")


class Service:
    """One cluster process that faults may SIGKILL and the harness restart with the same argv
    (so the same port and identity). Not thread-safe: one owner starts and stops it."""

    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.name, self.argv, self.log_path, self.env = name, argv, log_path, env
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> subprocess.Popen:
        """Start the process (again); the previous one must have exited."""
        if self.alive:
            raise RuntimeError(f"{self.name} is already running (pid {self.proc.pid})")
        self.starts += 1
        self.proc = _popen(self.argv, self.log_path, self.env)
        return self.proc

    def kill(self) -> None:
        """SIGKILL, as a crash or the OOM killer would, and reap it."""
        if self.alive:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `timeout_s`; always reaped."""
        if self.proc is not None:
            stop_process(self.proc, timeout_s)

    def check_alive(self) -> None:
        """Raise `BackendUnavailable`, with the log's tail, if the process has exited."""
        from backend.errors import BackendUnavailable

        if self.proc is not None and self.proc.poll() is not None:
            raise BackendUnavailable(f"{self.name} exited with status {self.proc.returncode} (a negative status "
                                     f"is a signal: -9 is often the kernel's OOM killer); its log ends:\n"
                                     f"{log_tail(self.log_path)}")


def mooncake_master_binary() -> str:
    """Path of the `mooncake_master` binary (the package folder, the environment's bin/, then PATH), or
    MooncakeUnavailable (the install hint) when the Mooncake wheel is not installed."""
    import importlib.util
    import shutil
    import sys

    from backend.mooncake_runtime import MooncakeUnavailable

    candidates: list[Path | str | None] = []
    spec = importlib.util.find_spec("mooncake")  # the package's folder, without loading its libraries
    if spec is not None and spec.submodule_search_locations:  # the binary itself (bin/'s is a Python wrapper)
        candidates += [Path(loc) / "mooncake_master" for loc in spec.submodule_search_locations]
    candidates += [Path(sys.prefix) / "bin" / "mooncake_master", shutil.which("mooncake_master")]
    for c in candidates:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return str(c)
    raise MooncakeUnavailable("no mooncake_master binary: install it with `pip install "
                              "mooncake-transfer-engine-non-cuda` (it ships the master)")


class MooncakeMaster:
    """A `mooncake_master` on `host`:`port` (a free port by default), output to `log_path`."""

    def __init__(self, log_path: Path, host: str = "127.0.0.1", port: int | None = None,
                 timeout_s: float = 10.0) -> None:
        from ops.redis_server import free_port

        self.host, self.port, self.log_path, self.timeout_s = host, port or free_port(), Path(log_path), timeout_s
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        """What workers pass as --kv-store."""
        return f"{self.host}:{self.port}"

    def start(self, attempts: int = 3) -> str:
        """Start it (again, on the same port) and wait until it accepts connections and is still running a
        moment later; return `address`. A master that exits while starting (its metrics port, picked free, may be
        taken before it binds it) is started again with another, up to `attempts` times."""
        from backend.errors import BackendUnavailable

        for _ in range(attempts):
            if self._start_once():
                return self.address
        raise BackendUnavailable(f"mooncake_master on {self.address} did not start in {self.timeout_s:.0f} s "
                                 f"({attempts} tries; exit status {self.proc.returncode if self.proc else None}); "
                                 f"its log ends:\n{log_tail(self.log_path)}")

    def _start_once(self) -> bool:
        import socket

        from ops.redis_server import free_port

        argv = [mooncake_master_binary(), f"--rpc_port={self.port}", f"--rpc_address={self.host}",
                f"--metrics_port={free_port()}", "--enable_metric_reporting=false"]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.proc = _popen(argv, self.log_path, {"GLOG_minloglevel": "2"})
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            with contextlib.suppress(OSError), socket.create_connection((self.host, self.port), timeout=0.2):
                time.sleep(0.2)  # listening; still there a moment later (not on its way out)?
                if self.proc.poll() is None:
                    return True
            time.sleep(0.02)
        self.stop()
        return False

    def kill(self) -> None:
        """SIGKILL it (a crash) and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def pause(self) -> None:
        """SIGSTOP: connections are accepted but nothing answers (a hung master)."""
        if self.proc is not None and self.proc.poll() is None:
            pause_process(self.proc)

    def resume(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        """SIGTERM (SIGKILL after 5 s); always reaped."""
        if self.proc is not None:
            self.resume()
            stop_process(self.proc, timeout_s=5)


@contextlib.contextmanager
def mooncake_master(log_path: Path | None = None, host: str = "127.0.0.1", port: int | None = None
                    ) -> Iterator[str]:
    """A fresh `mooncake_master` for the context's duration; yields its address ("host:port")."""
    import tempfile

    with contextlib.ExitStack() as stack:
        if log_path is None:
            log_path = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="edgeserve-mooncake-"))) / "m.log"
        master = MooncakeMaster(log_path, host, port)
        master.start()
        try:
            yield master.address
        finally:
            master.stop()


@contextlib.contextmanager
def kv_store_master(kv_store: str | None) -> Iterator[str]:
    """`edgeserve up --kv-store`: "" without a store, the given master address as is, or (with
    `ops.serve.EMBEDDED_KV_STORE`) a fresh `mooncake_master` started with SIGINT blocked (a terminal's
    Ctrl-C reaches only `up`, which stops it after the worker) and stopped when the context exits."""
    from ops.serve import EMBEDDED_KV_STORE

    if kv_store != EMBEDDED_KV_STORE:
        yield kv_store or ""
        return
    with contextlib.ExitStack() as stack:
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # the child inherits the mask
        try:
            address = stack.enter_context(mooncake_master())
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
        yield address


def _cpu_flags() -> list[str]:
    """The CPU's feature flags that matter for these kernels (AVX-512, AMX, BF16, FP16 ...)."""
    with contextlib.suppress(OSError, StopIteration):
        line = next(x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("flags"))
        wanted = ("avx", "amx", "bf16", "fp16", "fma", "vnni", "sse4")
        return sorted(f for f in line.split(":", 1)[1].split() if f.startswith(wanted) or "vnni" in f)
    return []


def machine_info() -> dict[str, Any]:
    """Host facts for a benchmark report: CPU model, count (and how many this process may use), flags,
    Python and platform."""
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return {"cpu_count": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)), "cpu_model": model,
            "cpu_flags": _cpu_flags(), "python": platform.python_version(), "platform": platform.platform()}
