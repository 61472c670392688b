"""The command line as a new user meets it: help, version, services that are not running, the cluster record, and
the allocator settings an engine command restarts itself with."""

from __future__ import annotations

import argparse
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ops import cluster_record
from ops.cli import HelpFormatter, build_parser
from ops.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]


def _edgeserve(*argv: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ops.cli", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "EDGESERVE_NO_REEXEC": "1", **(env or {})})


def test_help_imports_no_subcommand_module_and_is_quick() -> None:
    probe = ("import sys; from ops.cli import build_parser; text = build_parser('').format_help(); "
             "print(sorted(m for m in ('torch', 'ops.bench', 'ops.quantize', 'ops.up', 'httpx') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    t0 = time.monotonic()
    result = _edgeserve("--help")
    assert result.returncode == 0 and time.monotonic() - t0 < 1.0
    for command in ("up", "chat", "tenant", "key", "pull", "serve", "gateway", "bench", "quantize"):
        assert f"\n    {command} " in result.stdout
    assert "register(" not in result.stdout and "module" not in result.stdout
    assert "edgeserve up" in result.stdout and 'edgeserve chat "Hello!"' in result.stdout


def test_version_comes_from_the_package_metadata() -> None:
    from importlib.metadata import version

    result = _edgeserve("--version")
    assert result.returncode == 0 and result.stdout == f"edgeserve {version('edgeserve')}\n"


@pytest.mark.parametrize("command", ["serve", "up", "gateway"])
def test_every_flag_has_help_that_shows_its_default(command: str) -> None:
    parser = build_parser(command)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    formatter = HelpFormatter(f"edgeserve {command}")
    for action in sub._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{command} {action.option_strings[0]} has no help"
        if not isinstance(action, argparse._StoreTrueAction):  # switches are off unless given
            shown = formatter._expand_help(action)
            assert "default" in shown, f"{command} {action.option_strings[0]}: {shown!r} names no default"
    if command != "gateway":
        assert "(default: 512M)" in " ".join(sub.format_help().split())  # sizes as a user writes them


@pytest.mark.parametrize("argv", [["chat", "hello"], ["chat"], ["tenant", "list"], ["key", "create", "demo"],
                                  ["tenant", "create", "Acme"]])
def test_an_unreachable_service_is_one_line_that_says_what_to_run(argv: list[str], tmp_path: Path) -> None:
    nothing = free_port()
    env = {"EDGESERVE_HOME": str(tmp_path), "REDIS_URL": f"redis://127.0.0.1:{nothing}/0",
           "EDGESERVE_URL": f"http://127.0.0.1:{nothing}", "EDGESERVE_TOKEN": "es_not_checked"}
    result = _edgeserve(*argv, env=env)
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"127.0.0.1:{nothing}" in lines[0] and "make serve" in lines[0] and "edgeserve up" in lines[0]
    if argv[0] == "chat":
        assert lines[0].startswith(f"edgeserve: no gateway at http://127.0.0.1:{nothing};")
    assert result.stdout == ""


def _record(**overrides) -> cluster_record.ClusterRecord:
    fields = dict(gateway_url="http://127.0.0.1:18080", redis_url="redis://:pw@127.0.0.1:16379/0",
                  worker_urls=["http://127.0.0.1:18100"], worker_pids=[], model="tiny-chat", tenant_id="demo",
                  token="es_recorded")
    return cluster_record.new_record(**{**fields, **overrides})


def test_settings_prefer_flag_then_environment_then_record_then_default(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("EDGESERVE_HOME", str(tmp_path))
    monkeypatch.delenv("REDIS_URL", raising=False)
    assert cluster_record.setting(None, "REDIS_URL", "redis_url", "redis://default") == "redis://default"
    path = cluster_record.write_record(_record())
    assert path == tmp_path / "cluster.json" and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert cluster_record.setting(None, "REDIS_URL", "redis_url", "redis://default") == "redis://:pw@127.0.0.1:16379/0"
    monkeypatch.setenv("REDIS_URL", "redis://env")
    assert cluster_record.setting(None, "REDIS_URL", "redis_url", "redis://default") == "redis://env"
    assert cluster_record.setting("redis://flag", "REDIS_URL", "redis_url", "redis://default") == "redis://flag"
    cluster_record.remove_record(pid=os.getpid() + 1)  # not the writer's pid: kept
    assert cluster_record.read_record() is not None
    cluster_record.remove_record(pid=os.getpid())
    assert not path.exists()


def test_a_stale_record_is_ignored_said_so_and_removed(tmp_path: Path, capsys) -> None:
    live = _record()
    cluster_record.write_record(live, tmp_path)
    assert cluster_record.running_cluster(tmp_path) == live
    stale = _record()
    cluster_record.write_record(type(stale)(**{**{f: getattr(stale, f) for f in stale.__struct_fields__},
                                               "pid_started": stale.pid_started + 1}), tmp_path)  # a reused pid
    assert cluster_record.running_cluster(tmp_path) is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no longer running" in err and f"pid {os.getpid()}" in err
    assert not (tmp_path / "cluster.json").exists()


def test_chat_takes_gateway_token_and_model_from_the_record(tmp_path: Path, monkeypatch) -> None:
    from ops import chat

    for name in ("EDGESERVE_URL", "EDGESERVE_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("EDGESERVE_HOME", str(tmp_path))
    cluster_record.write_record(_record())
    args = build_parser("chat").parse_args(["chat"])
    chat._resolve(args)
    assert (args.url, args.token, args.model) == ("http://127.0.0.1:18080", "es_recorded", "tiny-chat")
    monkeypatch.setenv("EDGESERVE_TOKEN", "es_env")
    args = build_parser("chat").parse_args(["chat", "--url", "http://gw:1", "--model", "m"])
    chat._resolve(args)
    assert (args.url, args.token, args.model) == ("http://gw:1", "es_env", "m")


def _thp_mode() -> str:
    """The kernel's transparent huge page mode (the bracketed word), or "" where there is none to read."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return ""
    return text[text.find("[") + 1:text.find("]")] if "[" in text else ""


def test_an_engine_command_restarts_once_with_the_allocator_tunables(monkeypatch) -> None:
    from ops import cli

    calls: list[tuple[list[str], dict[str, str]]] = []
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv("EDGESERVE_NO_REEXEC", raising=False)
    monkeypatch.setattr(cli.os, "execve", lambda path, argv, env: calls.append((argv, env)))
    cli._reexec_with_allocator_tunables(["chat", "hi"])  # a client: not restarted
    cli._reexec_with_allocator_tunables(["serve", "--help"])
    assert calls == []
    cli._reexec_with_allocator_tunables(["serve", "--model", "m"])
    ((argv, env),) = calls
    assert argv[1:] == ["-m", "ops.cli", "serve", "--model", "m"] and env["GLIBC_TUNABLES"] == cli.ALLOCATOR_TUNABLES
    monkeypatch.setenv("GLIBC_TUNABLES", env["GLIBC_TUNABLES"])  # the restarted process: not again
    cli._reexec_with_allocator_tunables(["serve", "--model", "m"])
    assert len(calls) == 1


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always") or not Path("/proc/self/smaps_rollup").exists(),
                    reason="no transparent huge pages (or no smaps_rollup to count them) on this host")
def test_the_allocator_tunables_put_tensor_memory_in_huge_pages() -> None:
    """A process started with ALLOCATOR_TUNABLES holds a large tensor it wrote in 2 MiB pages: where the kernel
    grants them only on request (THP "madvise", as on the development VMs) only glibc's `hugetlb=1` asks."""
    from ops.cli import ALLOCATOR_TUNABLES

    probe = ("import torch; t = torch.ones(64 << 20, dtype=torch.uint8); "
             "print(next(l.split()[1] for l in open('/proc/self/smaps_rollup') if l.startswith('AnonHugePages')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120,
                         env={**os.environ, "GLIBC_TUNABLES": ALLOCATOR_TUNABLES}).stdout
    assert int(out) >= 2048  # kB: at least one huge page of the 64 MiB (others may not be free to have)
