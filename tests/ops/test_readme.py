"""The README's own command lines, run as a new user would, against a cluster started as it says.

Nothing here copies a command: the cluster is started with the recipe of the Makefile's
`serve` target (what the README's `make serve` runs), and every shell block of the README's
"Your first request" and "Tenants, keys and quotas" sections is run as written, with only
the token the banner printed put in `TOKEN`, the test's free ports in place of 8080, and
this environment's `edgeserve` in place of `.venv/bin/edgeserve`. Real SmolLM2 weights.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ops.pull import edgeserve_home, resolve_model
from ops.redis_server import free_ports
from tests.ops.test_up import read_banner

ROOT = Path(__file__).resolve().parents[2]
MARK = "@@readme-command@@"


def readme_commands(section: str) -> list[str]:
    """The commands of every ```sh block under `## {section}`, continuation lines joined."""
    text = (ROOT / "README.md").read_text()
    body = re.search(rf"^## {re.escape(section)}\n(.*?)(?=^## )", text, re.S | re.M)
    assert body is not None, f"README has no section {section!r}"
    commands: list[str] = []
    for block in re.findall(r"```sh\n(.*?)```", body.group(1), re.S):
        for command in re.sub(r"\\\n\s*", "", block).splitlines():
            if command.strip():
                commands.append(command)
    assert commands, f"no commands under {section!r}"
    return commands


def serve_recipe() -> list[str]:
    """The command `make serve` runs (the Makefile's recipe), as argv for this environment."""
    recipe = re.search(r"^serve:.*\n\t(.+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    argv = recipe.replace("$(BIN)/edgeserve", "edgeserve").split()
    assert argv[:2] == ["edgeserve", "up"], recipe
    return [sys.executable, "-m", "ops.cli", *argv[1:]]


def run_block(commands: list[str], env: dict[str, str], cwd: Path, port: int) -> list[str]:
    """Run `commands` in one bash (variables carry over, any failure stops it); each one's output."""
    edgeserve = str(Path(sys.executable).parent / "edgeserve")
    lines = ["set -euo pipefail"]
    for command in commands:
        command = command.replace(".venv/bin/edgeserve", edgeserve).replace("localhost:8080", f"127.0.0.1:{port}")
        lines += [command, f"echo {MARK}"]
    done = subprocess.run(["bash", "-c", "\n".join(lines)], env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=600)
    outputs = done.stdout.split(MARK + "\n")
    assert done.returncode == 0 and len(outputs) == len(commands) + 1, (done.stdout, done.stderr)
    return outputs[:-1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[tuple[dict[str, str], int, str]]:
    """`make serve`'s command on free ports, in its own edgeserve home (the model is shared)."""
    resolve_model("smollm2-135m")  # pulled once into the shared cache
    home = tmp_path_factory.mktemp("home")
    (home / "models").symlink_to(edgeserve_home() / "models")
    port, worker_port = free_ports(2)
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "EDGESERVE_TOKEN", "EDGESERVE_URL")}
    env.update(EDGESERVE_HOME=str(home), EDGESERVE_NO_REEXEC="1")
    proc = subprocess.Popen([*serve_recipe(), "--port", str(port), "--worker-port", str(worker_port)], env=env,
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        banner = read_banner(proc, 300)
        token = re.search(r"API token \(shown once\): (\S+)", banner).group(1)
        yield {**env, "TOKEN": token}, port, banner
        os.killpg(proc.pid, signal.SIGINT)  # the README: "Stop it with Ctrl-C"
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.model
def test_first_request_commands_work_as_written(cluster, tmp_path: Path) -> None:
    env, port, banner = cluster
    assert f"[3/3] gateway   http://127.0.0.1:{port}" in banner  # what the README says to wait for
    commands = readme_commands("Your first request")
    outputs = dict(zip(commands, run_block(commands, env, tmp_path, port)))
    for command, out in outputs.items():
        if command.startswith(".venv/bin/edgeserve chat \""):
            assert out.strip() and out.endswith("\n"), out  # one streamed reply, newline-terminated
        elif "/v1/chat/completions" in command:
            reply = json.loads(out)
            assert reply["choices"][0]["message"]["content"], out
        elif "/ai/run/" in command:
            assert '"response"' in out and out.rstrip().endswith("data: [DONE]"), out
        elif "/ai/usage" in command:
            usage = json.loads(out)
            assert usage["success"] is True and usage["result"], out  # the requests above are metered
    assert any("chat          #" in c for c in commands)  # the interactive line ran too (ended by EOF)


@pytest.mark.model
def test_tenant_commands_work_as_written_without_flags(cluster, tmp_path: Path) -> None:
    env, port, _ = cluster
    commands = readme_commands("Tenants, keys and quotas")
    outputs = run_block(commands, env, tmp_path, port)
    by_command = dict(zip(commands, outputs))
    reply = next(out for c, out in by_command.items() if "/v1/chat/completions" in c)
    assert json.loads(reply)["usage"]["completion_tokens"] >= 1, reply  # the new key works
    usage = json.loads(next(out for c, out in by_command.items() if "tenant usage acme" in c))
    assert sum(m["requests"] for day in usage["usage"].values() for m in day.values()) == 1, usage
    listed = {t["id"] for t in json.loads(next(out for c, out in by_command.items() if "tenant list" in c))}
    assert {"acme", "demo"} <= listed
    assert json.loads((tmp_path / "acme-key.json").read_text())["tenant_id"] == "acme"
