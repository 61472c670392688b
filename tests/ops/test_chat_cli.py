"""Interactive `edgeserve chat` driven as a user drives it (a subprocess, lines on stdin) against a real gateway."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.gateway.conftest import (  # noqa: F401 - fixtures
    MODEL, Gateway, Worker, gateway, metered, wait_metered, worker)

ROOT = Path(__file__).resolve().parents[2]


def _chat(gw: Gateway, tmp_path: Path, *argv: str) -> subprocess.Popen:
    """`edgeserve chat` as a terminal runs it: with Ctrl-C's signal at its default (a suite started as a shell's
    background job inherits SIGINT ignored, and Python then leaves it ignored: no KeyboardInterrupt)."""
    env = {**os.environ, "EDGESERVE_NO_REEXEC": "1", "EDGESERVE_HOME": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "ops.cli", "chat", "--url", gw.url, "--token", gw.account.token,
                             "--model", MODEL, "--temperature", "0", *argv], cwd=ROOT, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def test_quit_reset_and_the_trailing_newline(gateway: Gateway, redis_url: str, tmp_path: Path) -> None:  # noqa: F811
    proc = _chat(gateway, tmp_path, "--max-tokens", "3")
    out, err = proc.communicate("hello there\n/reset\nhi\nquit\n", timeout=60)
    assert proc.returncode == 0, err
    assert "/quit" in err and "Ctrl-D" in err and "/reset" in err  # the banner says how to leave and start over
    events = wait_metered(redis_url, gateway.account.tenant_id, 2)
    time.sleep(0.3)
    assert len(metered(redis_url, gateway.account.tenant_id)) == 2  # `quit` and `/reset` sent nothing
    first, second = (int(e["prompt_tokens"]) for e in events)
    # after /reset the second turn carries only its own user message ("hi" is shorter than "hello there",
    # and without the reset it would also carry the first turn and its reply)
    assert second < first
    assert out.count("> ") == 4 and out.endswith("> ")  # a prompt per line read
    replies = [part for part in out.split("> ") if part]
    assert len(replies) == 2 and all(reply.endswith("\n") for reply in replies)  # each reply ends its line


def test_one_message_ends_with_a_newline(gateway: Gateway, tmp_path: Path) -> None:  # noqa: F811
    proc = _chat(gateway, tmp_path, "--max-tokens", "3", "hello")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out.endswith("\n") and out.count("\n") == 1, (out, err)


def test_ctrl_c_stops_the_reply_not_the_session(gateway: Gateway, worker: Worker, redis_url: str,  # noqa: F811
                                                tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    step = worker.engine.step

    def slow_step():  # 400 tokens of the tiny model take under a second: too close to the signal on a busy machine
        time.sleep(0.005)
        return step()

    monkeypatch.setattr(worker.engine, "step", slow_step)
    proc = _chat(gateway, tmp_path, "--max-tokens", "400")
    try:
        proc.stdin.write("Tell me a very long story\n")
        proc.stdin.flush()
        assert proc.stdout.read(2) == "> "
        assert proc.stdout.read(1)  # the reply has begun
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate("/quit\n", timeout=60)  # the session goes on: it reads /quit and ends
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "[stopped]" in err and "Traceback" not in err
    assert out.endswith("\n> ")  # the stopped reply ended its line, then a new prompt
    event = wait_metered(redis_url, gateway.account.tenant_id, 1)[0]
    assert int(event["completion_tokens"]) < 400  # the gateway cancelled the reply


def test_end_of_input_ends_the_session(gateway: Gateway, tmp_path: Path) -> None:  # noqa: F811
    proc = _chat(gateway, tmp_path)
    out, err = proc.communicate("", timeout=60)
    assert proc.returncode == 0 and out == "> \n" and "Traceback" not in err

