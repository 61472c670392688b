"""`edgeserve` command line: one subcommand per module, each with `register(subparsers)`.

Subcommand modules are imported lazily by name so `edgeserve --help` stays fast and
no model or torch state is touched at import time.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

__all__ = ["main", "build_parser"]

# subcommand -> module that defines `register(subparsers)`; the module's parser sets `func`.
_SUBCOMMANDS: dict[str, str] = {
    "pull": "ops.pull",
    "serve": "ops.serve",
    "up": "ops.up",
    "gateway": "ops.gateway_cmd",
    "tenant": "ops.tenant",
    "key": "ops.tenant",
    "chat": "ops.chat",
    "bench": "ops.bench",
    "quantize": "ops.quantize",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Parser with every subcommand registered, or only `command`'s module when given (so running
    `edgeserve gateway` never imports the benchmarks, and with them torch)."""
    parser = argparse.ArgumentParser(prog="edgeserve", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    subparsers = parser.add_subparsers(dest="command", required=True)
    modules = [_SUBCOMMANDS[command]] if command in _SUBCOMMANDS else list(dict.fromkeys(_SUBCOMMANDS.values()))
    for module_name in modules:
        importlib.import_module(module_name).register(subparsers)
    return parser


def _command_of(argv: list[str]) -> str | None:
    return next((a for a in argv if not a.startswith("-")), None)


# glibc hands large tensor buffers back to the OS on free (mmap above 128 KiB, heap
# trimming), so every step page-faults its activations in again: ~10-15% of a decode
# step on the CPU runtime. Keeping freed memory in the heap removes that.
ALLOCATOR_TUNABLES = "glibc.malloc.mmap_threshold=4294967296:glibc.malloc.trim_threshold=4294967296"


def _reexec_with_allocator_tunables() -> None:
    """Restart this command once with ALLOCATOR_TUNABLES (glibc reads them only at start-up)."""
    if sys.platform != "linux" or "GLIBC_TUNABLES" in os.environ or os.environ.get("EDGESERVE_NO_REEXEC"):
        return
    env = {**os.environ, "GLIBC_TUNABLES": ALLOCATOR_TUNABLES}
    os.execve(sys.executable, [sys.executable, "-m", "ops.cli", *sys.argv[1:]], env)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `edgeserve` console script."""
    if argv is None:
        _reexec_with_allocator_tunables()
    args_list = sys.argv[1:] if argv is None else argv
    parser = build_parser(_command_of(args_list))
    args = parser.parse_args(args_list)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format='{"ts":"%(asctime)s","level":"%(levelname)s","logger":"%(name)s","msg":"%(message)s"}',
        stream=sys.stderr,
    )
    from backend.errors import EdgeServeError

    try:
        return int(args.func(args) or 0)
    except EdgeServeError as exc:
        print(f"edgeserve: error {exc.code} ({type(exc).__name__}): {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
