"""Container command lines parsed by the parsers that will read them (test helper, not a test).

A container that runs `edgeserve gateway`, `edgeserve serve` or `torchrun ... -m ops.cli serve`
has its command and args expanded with its environment (`k8s_pods.container_env`) and
parsed by `ops.cli.build_parser` (and torchrun's own parser first), with the process
environment set to the container's while the parser is built, because flag defaults
read it (`--redis-url` from `$REDIS_URL`). Flags in `PENDING_FLAGS` are set aside
only while the parser does not know them yet; once it does, they are parsed like any
other.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from typing import Any

import pytest

from tests.ops.k8s_pods import Pod, container_env, expand, pods
from tests.ops.kustomize_render import Resource

__all__ = ["PENDING_FLAGS", "Command", "parse_command", "commands"]

# flags issue 15 adds to `edgeserve serve`, written as they will be: flag -> takes a value
PENDING_FLAGS = {"--tensor-parallel": True, "--expert-parallel": False}


class Command:
    """A container's edgeserve command line, expanded and parsed by the real parsers."""

    def __init__(self, subcommand: str, argv: list[str], args: argparse.Namespace, pending: dict[str, str | None],
                 torchrun: argparse.Namespace | None) -> None:
        self.subcommand, self.argv, self.args, self.pending, self.torchrun = subcommand, argv, args, pending, torchrun

    def value(self, flag: str) -> Any:
        """A flag's parsed value, pending flags included (None when absent)."""
        dest = flag.lstrip("-").replace("-", "_")
        if hasattr(self.args, dest):
            return getattr(self.args, dest)
        return self.pending.get(flag, True if flag in self.pending else None)


def parse_command(container: Resource, env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Command | None:
    """The container's command line expanded with `env` and parsed; None when it does not run edgeserve.
    A line the parser rejects fails the test with the words it was given."""
    argv = [expand(a, env) for a in container.get("command", []) + container.get("args", [])]
    torchrun = None
    if argv[:1] == ["torchrun"]:
        from torch.distributed.run import get_args_parser

        torchrun = get_args_parser().parse_args(argv[1:])
        assert torchrun.module and torchrun.training_script == "ops.cli", "torchrun must run `-m ops.cli`"
        argv = ["edgeserve", *torchrun.training_script_args]
    if argv[:1] != ["edgeserve"]:
        return None
    from ops.cli import build_parser

    for name in list(os.environ):  # flag defaults read the environment when the parser is built
        if name.startswith(("EDGESERVE_", "REDIS_")):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    subcommand = argv[1]
    parser = build_parser(subcommand)
    (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    known = set(subparsers.choices[subcommand]._option_string_actions)
    rest, pending = [], {}
    words = iter(argv[2:])
    for word in words:
        flag, has_value, value = word.partition("=")
        if flag in PENDING_FLAGS and flag not in known:
            pending[flag] = (value if has_value else next(words)) if PENDING_FLAGS[flag] else None
        else:
            rest.append(word)
    try:
        args = parser.parse_args([subcommand, *rest])
    except SystemExit as exc:
        raise AssertionError(f"edgeserve {subcommand} rejects {rest}") from exc
    return Command(subcommand, argv, args, pending, torchrun)


def commands(resources: list[Resource], monkeypatch: pytest.MonkeyPatch
             ) -> Iterator[tuple[Pod, Resource, dict[str, str], Command]]:
    """(pod, container, environment, parsed command) for every container that runs edgeserve.

    While each is yielded, the process environment holds that container's (through `monkeypatch`), so
    code that reads it (`resolve_token`, `edgeserve_home`) sees what the container would."""
    for pod in pods(resources):
        for container in pod.spec["containers"]:
            env = container_env(resources, pod, container)
            cmd = parse_command(container, env, monkeypatch)
            if cmd is not None:
                yield pod, container, env, cmd
