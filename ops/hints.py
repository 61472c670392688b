"""What the command line tells a user to run next.

`edgeserve_command` is the path that runs `edgeserve` from the user's shell as it is
now (``edgeserve`` when the PATH finds this one, else ``.venv/bin/edgeserve`` or an
absolute path), for banners and hints. `unreachable_line` turns a failure to reach
a service (a gateway, Redis) into the one line the CLI prints instead of a traceback:
what did not answer, where, and how to start it.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

__all__ = ["edgeserve_command", "start_hint", "unreachable_line"]


def edgeserve_command() -> str:
    """How to run `edgeserve` from the current directory: the bare name only if PATH finds this install."""
    script = Path(sys.executable).parent / "edgeserve"
    if not script.exists():
        return "edgeserve"
    on_path = shutil.which("edgeserve")
    if on_path and Path(on_path).resolve() == script.resolve():
        return "edgeserve"
    relative = os.path.relpath(script, Path.cwd())
    return relative if not relative.startswith("..") else str(script)


def start_hint() -> str:
    """'start it with `make serve` (or `.venv/bin/edgeserve up`)'."""
    return f"start it with `make serve` (or `{edgeserve_command()} up`)"


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def unreachable_line(exc: BaseException, command: str | None) -> str | None:
    """The one line for `exc` if it means a service did not answer (None otherwise).

    `command` is the subcommand that ran: `chat` talks to a gateway, the admin
    commands to Redis."""
    import httpx
    from redis.exceptions import ConnectionError as RedisConnectionError

    from backend.errors import StoreUnavailable

    if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
        try:
            url = exc.request.url
            where = f"{url.scheme}://{url.host}:{url.port or (443 if url.scheme == 'https' else 80)}"
        except RuntimeError:  # no request attached
            where = "the address given"
        if command == "chat":
            return f"edgeserve: no gateway at {where}; {start_hint()}, or pass --url"
        return f"edgeserve: nothing answers at {where} ({_one_line(exc) or type(exc).__name__})"
    if isinstance(exc, StoreUnavailable):
        return (f"edgeserve: error {exc.code} ({type(exc).__name__}): {_one_line(exc.message)}; is the cluster "
                f"running? {start_hint()}, or pass --redis-url")
    if isinstance(exc, RedisConnectionError):
        return f"edgeserve: Redis is unreachable ({_one_line(exc)}); {start_hint()}, or pass --redis-url"
    return None
