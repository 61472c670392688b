"""`edgeserve up` as a user runs it: Redis, worker and gateway come up and answer; the commands the banner
prints work as printed, with no flags; a second `up` on the same ports says so in one line; Ctrl-C stops
everything in order and quietly."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from ops.redis_server import free_port, free_ports

ROOT = Path(__file__).resolve().parents[2]


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _env(home: Path) -> dict[str, str]:
    drop = {"REDIS_URL", "EDGESERVE_TOKEN", "EDGESERVE_URL", "EDGESERVE_WORKER_TOKEN"}
    return {**{k: v for k, v in os.environ.items() if k not in drop}, "EDGESERVE_NO_REEXEC": "1",
            "EDGESERVE_HOME": str(home)}


def _edgeserve(home: Path, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ops.cli", *argv], cwd=ROOT, env=_env(home), capture_output=True,
                          text=True, timeout=timeout)


def test_up_refuses_a_port_in_use_before_starting_anything(tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        t0 = time.monotonic()
        result = _edgeserve(tmp_path, "up", "--model", str(tmp_path / "no-such-model"), "--port", str(port),
                            "--worker-port", str(free_port()))
    assert result.returncode == 1 and time.monotonic() - t0 < 10
    assert result.stderr.splitlines() == [result.stderr.strip()]  # one line
    assert f"port {port} (gateway) is in use by pid {os.getpid()} (" in result.stderr and "--port" in result.stderr
    assert result.stdout == "" and not (tmp_path / "cluster.json").exists()


def read_banner(proc: subprocess.Popen, timeout_s: float) -> str:
    """`up`'s output up to its banner's last line (printed once the gateway listens)."""
    banner: list[str] = []
    deadline = time.monotonic() + timeout_s
    while not any("Ctrl-C stops everything" in line for line in banner):
        line = proc.stdout.readline()
        assert line and time.monotonic() < deadline, "".join(banner)
        banner.append(line)
    return "".join(banner)


def test_up_serves_records_itself_and_ctrl_c_stops_every_child_quietly(tiny_chat_dir, tmp_path: Path) -> None:
    port, worker_port = free_ports(2)
    argv = ["up", "--model", str(tiny_chat_dir), "--served-name", "tiny-chat", "--port", str(port),
            "--worker-port", str(worker_port), "--kv-cache-bytes", "4M", "--threads", "1"]
    proc = subprocess.Popen([sys.executable, "-m", "ops.cli", *argv], cwd=ROOT, env=_env(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its own process group, as a terminal's foreground job
    try:
        text = read_banner(proc, 120)
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

        # the record: the token and Redis for the commands that follow, readable by this user only
        record_file = tmp_path / "cluster.json"
        record = json.loads(record_file.read_text())
        assert stat.S_IMODE(record_file.stat().st_mode) == 0o600 and str(record_file) in text
        assert record["token"] == token and record["pid"] == proc.pid and record["tenant_id"] == "demo"
        assert record["redis_url"] == f"redis://127.0.0.1:{redis_port}/0" and record["model"] == "tiny-chat"
        # secrets reach the worker through its environment: `ps` (argv) shows neither the token nor Redis
        worker_argv = Path(f"/proc/{record['worker_pids'][0]}/cmdline").read_bytes().decode()
        assert "redis://" not in worker_argv and token not in worker_argv and "serve" in worker_argv

        # the banner's commands, as printed (a path that runs from here), with no flags
        command = re.search(r"^\s+(\S*edgeserve) chat \"Hello!\"$", text, re.M).group(1)
        assert shutil.which(command) or (ROOT / command).exists()
        for line in (f'{command} tenant list', f'{command} key create demo'):
            assert f"\n  {line}\n" in text
        chat = _edgeserve(tmp_path, "chat", "Hello!", "--max-tokens", "4")
        assert chat.returncode == 0 and chat.stdout.endswith("\n"), chat.stderr
        listed = _edgeserve(tmp_path, "tenant", "list")
        assert listed.returncode == 0 and "demo" in [t["id"] for t in json.loads(listed.stdout)], listed.stderr

        # a second `up` on these ports: one line naming this cluster, no banner, no token
        second = _edgeserve(tmp_path, *argv)
        assert second.returncode == 1 and second.stdout == ""
        assert second.stderr.startswith(f"edgeserve up: a cluster is already running (pid {proc.pid}, gateway "
                                        f"http://127.0.0.1:{port}") and second.stderr.count("\n") == 1
        assert json.loads(record_file.read_text())["token"] == token  # the running cluster's record is untouched

        # Ctrl-C with a reply streaming: it finishes, then gateway, worker and Redis stop in that order
        streamed: list[str] = []

        def stream() -> None:
            with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60,
                              headers={"authorization": f"Bearer {token}"},
                              json={"model": "tiny-chat", "messages": [{"role": "user", "content": "go"}],
                                    "max_tokens": 300, "stream": True}) as r:
                streamed.extend(r.iter_lines())

        reader = threading.Thread(target=stream)
        reader.start()
        while not streamed and reader.is_alive():
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        reader.join(timeout=60)
        # an error event has an "error" key (a token's text may be `error` too: a substring test matched it)
        errors = [line for line in streamed if line.startswith("data: {") and "error" in json.loads(line[6:])]
        assert "data: [DONE]" in streamed and not errors, (errors, streamed[-3:])
        assert proc.wait(timeout=60) == 0
        after = proc.stdout.read()
        assert after.rstrip().endswith("stopped gateway, worker and redis")
        assert "Traceback" not in after and "WARNING" not in after and "ERROR" not in after, after
        time.sleep(0.5)
        assert not any(_port_open(p) for p in (port, worker_port, redis_port))
        assert not record_file.exists()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
