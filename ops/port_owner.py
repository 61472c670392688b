"""Whether a local TCP port is free, and which process listens on it when it is not.

`port_free` asks the kernel the way a server would (bind with SO_REUSEADDR, as
uvicorn does). `port_holder` finds the listener through procfs: the socket's inode
from /proc/net/tcp and tcp6 (state 0A, LISTEN), then the process whose
/proc/<pid>/fd links to ``socket:[inode]``. Only processes this user may inspect
are found (root sees all); otherwise the holder is unknown (None).
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path
from typing import NamedTuple

__all__ = ["PortHolder", "port_free", "port_holder", "describe_holder"]

_LISTEN = "0A"


class PortHolder(NamedTuple):
    pid: int
    command: str  # its command line, arguments joined by spaces


def port_free(host: str, port: int) -> bool:
    """Whether a server could listen on `host`:`port` now."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _listening_inodes(port: int) -> set[str]:
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if len(fields) > 9 and fields[3] == _LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(fields[9])
    return inodes


def port_holder(port: int) -> PortHolder | None:
    """The process listening on TCP `port` (any address), or None when none is visible to this user."""
    targets = {f"socket:[{inode}]" for inode in _listening_inodes(port)}
    if not targets:
        return None
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) in targets:
                        raw = (proc / "cmdline").read_bytes().rstrip(b"\0")
                        return PortHolder(int(proc.name), raw.replace(b"\0", b" ").decode(errors="replace"))
    return None


def describe_holder(holder: PortHolder | None, max_chars: int = 80) -> str:
    """'pid 123 (python -m http.server)', or 'a process this user cannot see' when unknown."""
    if holder is None:
        return "a process this user cannot see (another user's, or in another network namespace)"
    command = holder.command if len(holder.command) <= max_chars else holder.command[: max_chars - 3] + "..."
    return f"pid {holder.pid} ({command})"
