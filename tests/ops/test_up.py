"""`edgeserve up` as a user runs it: Redis, worker and gateway come up, answer, and all stop on Ctrl-C."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx

from ops.redis_server import free_port


def _port_open(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_up_serves_a_chat_and_ctrl_c_stops_every_child(tiny_chat_dir) -> None:
    port, worker_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ops.cli", "up", "--model", str(tiny_chat_dir), "--served-name", "tiny-chat",
         "--port", str(port), "--worker-port", str(worker_port), "--kv-cache-bytes", "4M", "--threads", "1"],
        env={**env, "EDGESERVE_NO_REEXEC": "1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)  # its own process group, as a terminal's foreground job
    banner: list[str] = []
    try:
        deadline = time.monotonic() + 120
        while not any("Ctrl-C stops everything" in line for line in banner):
            line = proc.stdout.readline()
            assert line and time.monotonic() < deadline, "".join(banner)
            banner.append(line)
        text = "".join(banner)
        token = re.search(r"API token \(shown once\): (\S+)", text).group(1)
        redis_port = int(re.search(r"redis\s+redis://127\.0\.0\.1:(\d+)", text).group(1))
        for _ in range(50):  # the gateway starts right after the banner
            if _port_open(port):
                break
            time.sleep(0.1)
        resp = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", headers={"authorization": f"Bearer {token}"},
                          json={"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
                          timeout=60)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 4
        assert _port_open(worker_port) and _port_open(redis_port)

        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        assert proc.wait(timeout=30) == 0
        assert "stopped gateway, worker and redis" in proc.stdout.read()
        time.sleep(0.5)
        assert not any(_port_open(p) for p in (port, worker_port, redis_port))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
