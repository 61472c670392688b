"""`edgeserve` command line: one subcommand per module, each with `register(subparsers)`.

Only the module of the command being run is imported (`edgeserve --help` lists the
others by name from `SUBCOMMANDS`), so help is instant and no model or torch state is
touched at import time. Every parser shows each flag's default (`HelpFormatter`).

Errors end here in one line on stderr: a typed `EdgeServeError` as its code and
message (exit 2), a service that does not answer as what to start (`ops.hints`,
exit 2), Ctrl-C quietly (exit 130). `-v` adds the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import traceback

__all__ = ["main", "build_parser", "HelpFormatter", "SUBCOMMANDS"]

DESCRIPTION = """\
edgeserve runs a multi-tenant LLM inference service on this machine: a gateway that
speaks the OpenAI and Cloudflare Workers AI APIs, in front of workers that run the model.

start here:
  edgeserve up                 run Redis, a worker and the gateway; prints an API token
  edgeserve chat "Hello!"      talk to the model (no flags needed while `up` runs)
  edgeserve tenant create NAME add a tenant; `edgeserve key create TENANT_ID` gives it a key
"""

# subcommand -> (module that defines `register(subparsers)`, one-line help for `edgeserve --help`)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "up": ("ops.up", "run the local cluster (Redis, a worker and the gateway) until Ctrl-C"),
    "chat": ("ops.chat", "chat with a model through the gateway, streamed"),
    "tenant": ("ops.tenant", "create, list and inspect tenants and their quotas"),
    "key": ("ops.tenant", "create and revoke API keys"),
    "pull": ("ops.pull", "download a model into the local cache"),
    "serve": ("ops.serve", "run one worker (role unified, prefill or decode)"),
    "gateway": ("ops.gateway_cmd", "run a gateway replica in front of running workers"),
    "bench": ("ops.bench", "run a benchmark (prints a table, writes JSON)"),
    "quantize": ("ops.quantize", "convert a checkpoint's linear layers to INT4 or FP8"),
    "kv-budget": ("ops.kv_budget", "KV bytes per token per format and the tokens that fit, from a config alone"),
}

# commands that run the engine get the allocator tunables (see _reexec_with_allocator_tunables)
_ENGINE_COMMANDS = frozenset({"serve", "up", "bench", "quantize"})
# one-shot clients: the warnings of the server-side code they call (an outage log that "retries until
# Redis returns") would only repeat the one line they end with; -v shows them
_CLIENT_COMMANDS = frozenset({"chat", "tenant", "key"})


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Descriptions as written; every flag's help ends with its default, unless the help already names
    one or the flag is an on/off switch (off by default)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is None or isinstance(action.default, bool) \
                or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """ArgumentParser whose subcommand parsers (made with `parser_class=type(parent)`) share HelpFormatter."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003 - argparse's signature
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"edgeserve {version('edgeserve')}"
    except PackageNotFoundError:
        return "edgeserve (not installed as a package)"


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `edgeserve` parser. With `command` None every subcommand module is imported and registered;
    otherwise only `command`'s module (none for "" or an unknown name), the rest listed by name and help."""
    parser = _Parser(prog="edgeserve", description=DESCRIPTION,
                     epilog="Run `edgeserve COMMAND --help` for a command's flags.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging, and tracebacks on errors")
    parser.add_argument("--version", action="version", version=_version())
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    wanted = {module for module, _ in SUBCOMMANDS.values()} if command is None else (
        {SUBCOMMANDS[command][0]} if command in SUBCOMMANDS else set())
    for module_name in dict.fromkeys(module for module, _ in SUBCOMMANDS.values()):
        if module_name in wanted:
            importlib.import_module(module_name).register(subparsers)
    for name, (module_name, text) in SUBCOMMANDS.items():
        if module_name not in wanted:
            subparsers.add_parser(name, help=text, add_help=False)
    # the listing in SUBCOMMANDS' order, whatever order the parsers were added in
    order = list(SUBCOMMANDS)
    subparsers._choices_actions.sort(key=lambda a: order.index(a.dest) if a.dest in order else len(order))
    return parser


def _command_of(argv: list[str]) -> str:
    return next((a for a in argv if not a.startswith("-")), "")


# glibc hands large tensor buffers back to the OS on free (mmap above 128 KiB, heap
# trimming), so every step page-faults its activations in again: ~10-15% of a decode
# step on the CPU runtime. Keeping freed memory in the heap removes that. `hugetlb=1`
# has malloc ask for transparent huge pages (madvise) as the heap grows, so the weights
# and KV pages a step streams lie in 2 MiB pages, not 4 KiB ones (fewer TLB misses and
# page walks): SmolLM2's bf16 decode step 1.06x faster at c = 1, 1.04x at c = 32 on a
# 2-core Xeon VM whose kernel grants them on request (THP "madvise"; BENCHMARKS.md).
# The heap is never trimmed, so steady-state steps fault nothing in either way.
ALLOCATOR_TUNABLES = ("glibc.malloc.mmap_threshold=4294967296:glibc.malloc.trim_threshold=4294967296"
                      ":glibc.malloc.hugetlb=1")


def _reexec_with_allocator_tunables(argv: list[str]) -> None:
    """Restart an engine command once with ALLOCATOR_TUNABLES (glibc reads them only at start-up)."""
    if (sys.platform != "linux" or "GLIBC_TUNABLES" in os.environ or os.environ.get("EDGESERVE_NO_REEXEC")
            or _command_of(argv) not in _ENGINE_COMMANDS or {"-h", "--help", "--version"} & set(argv)):
        return
    env = {**os.environ, "GLIBC_TUNABLES": ALLOCATOR_TUNABLES}
    os.execve(sys.executable, [sys.executable, "-m", "ops.cli", *argv], env)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `edgeserve` console script."""
    args_list = sys.argv[1:] if argv is None else argv
    if argv is None:
        _reexec_with_allocator_tunables(args_list)
    command = _command_of(args_list)
    args = build_parser(command).parse_args(args_list)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.ERROR if command in _CLIENT_COMMANDS else logging.WARNING,
        format='{"ts":"%(asctime)s","level":"%(levelname)s","logger":"%(name)s","msg":"%(message)s"}',
        stream=sys.stderr,
    )
    from backend.errors import EdgeServeError
    from ops.hints import unreachable_line

    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - the CLI boundary: one line for what a user can act on
        line = unreachable_line(exc, command)
        if line is None and isinstance(exc, EdgeServeError):
            line = f"edgeserve: error {exc.code} ({type(exc).__name__}): {exc.message}"
        if line is None:
            raise
        if args.verbose:
            traceback.print_exc()
        print(line, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
