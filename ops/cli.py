"""`edgeserve` command line: one subcommand per module, each with `register(subparsers)`.

Subcommand modules are imported lazily by name so `edgeserve --help` stays fast and
no model or torch state is touched at import time.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

__all__ = ["main", "build_parser"]

# subcommand -> module that defines `register(subparsers)`; the module's parser sets `func`.
_SUBCOMMANDS: dict[str, str] = {
    "pull": "ops.pull",
    "serve": "ops.serve",
    "up": "ops.serve",
    "chat": "ops.chat",
    "bench": "ops.bench",
}


def build_parser() -> argparse.ArgumentParser:
    """Parser with every subcommand registered."""
    parser = argparse.ArgumentParser(prog="edgeserve", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    subparsers = parser.add_subparsers(dest="command", required=True)
    registered: set[str] = set()
    for module_name in dict.fromkeys(_SUBCOMMANDS.values()):
        module = importlib.import_module(module_name)
        module.register(subparsers)
        registered.add(module_name)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `edgeserve` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
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
