"""`edgeserve bench gateway`'s processes: Redis, the per-token stand-in worker, the framework floor's
pass-through proxy (`passthrough`), the edgeserve gateway (and, with ``--baseline REF``, a second one run from
``git archive REF``) with a tenant without quotas and one with both, and LiteLLM's proxy from its own venv
(installed on first use)."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from ops.bench.gateway.load import MODEL, Target, expected_text_check, worker_body
from ops.bench.harness.tenants import create_tenants
from ops.cluster import child_process, wait_http

__all__ = ["LITELLM_VENV", "QUOTA_LIMITS", "ensure_litellm", "has_modules", "start_targets", "check_all"]

LITELLM_VENV = Path.home() / ".cache" / "edgeserve" / "bench-venvs" / "litellm"
QUOTA_LIMITS = {"requests_per_minute": 10**9, "tokens_per_day": 10**15}  # enforced, never reached


def ensure_litellm(venv: Path) -> tuple[Path | None, str | None, str]:
    """(litellm executable, version, note): installs litellm[proxy] into `venv` on first use, showing pip's output."""
    exe, python = venv / "bin" / "litellm", venv / "bin" / "python"
    try:
        if not exe.exists():
            print(f"installing litellm[proxy] into {venv} (first run only; a few minutes) ...", file=sys.stderr,
                  flush=True)
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            subprocess.run([str(python), "-m", "pip", "install", "litellm[proxy]"], check=True,
                           stdout=sys.stderr)
        version = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('litellm'))"],
                                 check=True, capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as exc:
        return None, None, f"litellm[proxy] did not install into {venv}: {exc}"
    return exe, version, "ok"


def has_modules(python: str, names: list[str]) -> dict[str, bool]:
    code = "import importlib.util as u, sys; print(' '.join(str(u.find_spec(n) is not None) for n in sys.argv[1:]))"
    try:
        out = subprocess.run([python, "-c", code, *names], check=True, capture_output=True, text=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        return {}
    return {n: v == "True" for n, v in zip(names, out)}


def _litellm_config(path: Path, standin_url: str, master_key: str) -> None:
    path.write_text(f"""model_list:
  - model_name: {MODEL}
    litellm_params:
      model: openai/{MODEL}
      api_base: {standin_url}/v1
      api_key: dummy
general_settings:
  master_key: {master_key}
""")


async def _tenant_tokens(redis_url: str) -> dict[str, str]:
    """API tokens of two new tenants: "" without quotas, "+quota" with `QUOTA_LIMITS`."""
    kinds = {"": {}, "+quota": QUOTA_LIMITS}
    made = await create_tenants(redis_url, [(f"bench-gateway{suffix}", limits) for suffix, limits in kinds.items()])
    return {suffix: tenant.token for suffix, tenant in zip(kinds, made)}


def _source_tree(ref: str, into: Path) -> str:
    """Extract commit `ref` of this checkout into `into` (`git archive`); its short hash."""
    root = Path(__file__).resolve().parents[3]
    commit = subprocess.run(["git", "rev-parse", "--short", ref], cwd=root, check=True, capture_output=True,
                            text=True).stdout.strip()
    into.mkdir(parents=True)
    archive = subprocess.Popen(["git", "archive", "--format=tar", commit], cwd=root, stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(into)], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        raise RuntimeError(f"git archive {commit} failed")
    return commit


def start_targets(stack: contextlib.ExitStack, num_tokens: int, litellm_exe: Path | None, litellm_note: str,
                   baseline_ref: str | None, log: Callable[[str], None]) -> tuple[list[Target], str, str | None]:
    """Start Redis, the stand-in, the pass-through, the gateway (with two tenants), the baseline's gateway and
    LiteLLM if asked; stopped by `stack`. Returns the targets, LiteLLM's note and the baseline's short commit."""
    from ops.redis_server import free_ports, run_redis_server

    logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="edgeserve-bench-gateway-")))
    redis_url = stack.enter_context(run_redis_server())
    ports = iter(free_ports(5))  # stand-in, pass-through, gateway, baseline gateway, LiteLLM: distinct before binds
    standin_url = f"http://127.0.0.1:{next(ports)}"
    standin = stack.enter_context(child_process(
        [sys.executable, "-m", "ops.bench.gateway.standin_per_token", "--port", standin_url.rsplit(":", 1)[1],
         "--tokens", str(num_tokens)], logs / "standin.log"))
    passthrough_url = f"http://127.0.0.1:{next(ports)}"
    passthrough = stack.enter_context(child_process(
        [sys.executable, "-m", "ops.bench.gateway.passthrough", "--port", passthrough_url.rsplit(":", 1)[1],
         "--upstream", standin_url], logs / "passthrough.log"))
    gateway_argv = ["gateway", "--model", MODEL, "--worker", standin_url, "--redis-url", redis_url,
                    "--served-name", MODEL]
    gateways: dict[str, tuple[subprocess.Popen, str]] = {}
    baseline = None if baseline_ref is None else _source_tree(baseline_ref, logs / "baseline")
    for suffix, tree in (("", None), *((() if baseline is None else ((f"@{baseline}", logs / "baseline"),)))):
        port = next(ports)
        # The baseline's packages first on sys.path (they shadow this checkout's), then its CLI as `-m` would run.
        argv = ([sys.executable, "-m", "ops.cli"] if tree is None else [
            sys.executable, "-c", f"import runpy, sys; sys.path.insert(0, {str(tree)!r}); "
                                  "runpy.run_module('ops.cli', run_name='__main__', alter_sys=True)"])
        proc = stack.enter_context(child_process([*argv, *gateway_argv, "--port", str(port)],
                                                 logs / f"gateway{suffix}.log"))
        gateways[suffix] = proc, f"http://127.0.0.1:{port}"
    litellm = None
    if litellm_exe is not None:  # starts while the others come up; it is the slowest
        litellm_port, master_key = next(ports), "sk-bench-" + secrets.token_hex(8)
        _litellm_config(logs / "litellm.yaml", standin_url, master_key)
        litellm = stack.enter_context(child_process(
            [str(litellm_exe), "--config", str(logs / "litellm.yaml"), "--host", "127.0.0.1",
             "--port", str(litellm_port)], logs / "litellm.log", env={"LITELLM_LOCAL_MODEL_COST_MAP": "True"}))
    wait_http(f"{standin_url}/health", standin, logs / "standin.log", "the stand-in worker", 30)
    tokens = asyncio.run(_tenant_tokens(redis_url))
    targets = [Target("direct", f"{standin_url}/v1/chat/completions", {}, None),
               Target("worker", f"{standin_url}/v1/generate", {}, None, worker_body(num_tokens))]
    wait_http(f"{passthrough_url}/healthz", passthrough, logs / "passthrough.log", "the pass-through proxy", 30)
    targets.append(Target("passthrough", f"{passthrough_url}/v1/chat/completions", {}, passthrough.pid))
    for suffix, (proc, url) in gateways.items():
        wait_http(f"{url}/healthz", proc, logs / f"gateway{suffix}.log", f"the edgeserve gateway{suffix}", 60)
        targets += [Target(f"edgeserve{kind}{suffix}", f"{url}/v1/chat/completions",
                           {"authorization": f"Bearer {token}"}, proc.pid) for kind, token in tokens.items()]
    if litellm is not None:
        litellm_url = f"http://127.0.0.1:{litellm_port}"
        try:
            wait_http(f"{litellm_url}/health/liveliness", litellm, logs / "litellm.log", "LiteLLM's proxy", 180)
            targets.append(Target("litellm", f"{litellm_url}/v1/chat/completions",
                                  {"authorization": f"Bearer {master_key}"}, litellm.pid))
        except Exception as exc:  # noqa: BLE001 - LiteLLM is a comparison, not a requirement
            litellm_note = f"installed but did not start: {exc}"
            log(f"litellm: {litellm_note}")
    return targets, litellm_note, baseline


async def check_all(targets: list[Target], num_tokens: int, expected: str) -> dict[str, str | None]:
    import httpx

    async with httpx.AsyncClient(timeout=60) as client:
        return {t.name: await expected_text_check(client, t, num_tokens, expected) for t in targets if t.body is None}
