"""The Mooncake libraries, loaded once per process: Transfer Engine and Store clients.

Mooncake (`mooncake-transfer-engine-non-cuda` on PyPI; `-cuda13` etc. for GPU memory)
moves bytes between registered memory regions of two processes: RDMA where an
RDMA device exists, TCP otherwise. Its native library needs Debian's
`libibverbs1` at import even without an RDMA device; `make install` installs it
when run as root. Everything here raises `MooncakeUnavailable` (= `BackendUnavailable`)
with that install hint when the library cannot be loaded,
so a worker started with `--kv-transport mooncake` on a machine without it stops
at start, not at its first request.

Logging: the library logs through glog at INFO by default (several lines per engine
start and connection). Unless the environment already sets `MC_LOG_LEVEL`, it is set
to ERROR before the first import, to keep workers quiet by default.

Protocols: ``tcp`` (default; loopback in tests) or ``rdma`` with a device list
(`EDGESERVE_MOONCAKE_DEVICES`, e.g. ``mlx5_0,mlx5_1``; empty = auto-discovery).
The handshake is peer to peer (``P2PHANDSHAKE``): no metadata server; a peer is
named by ``host:rpc_port`` (`session_id`), the host being `advertised_host`
(EDGESERVE_MOONCAKE_HOST, else the worker's bind address).
"""

from __future__ import annotations

import os
import socket
import threading
from typing import Any

from backend.errors import BackendUnavailable

__all__ = ["MooncakeUnavailable", "load", "TransferEngineHandle", "transfer_engine", "protocol", "advertised_host"]

_INSTALL_HINT = ("install it with `pip install mooncake-transfer-engine-non-cuda` (GPU memory: the -cuda13 "
                 "variant) and Debian's `apt-get install libibverbs1`")


# The library is missing or could not start. An alias, not a subclass: a typed error is rebuilt from
# its wire code (errors.error_from_code), and a second class with BackendUnavailable's code would
# rename every 5003 error in the process.
MooncakeUnavailable = BackendUnavailable


def load() -> Any:
    """The `mooncake` package (engine and store modules imported), or MooncakeUnavailable."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    try:
        import mooncake.engine  # noqa: F401  (loads libibverbs)
        import mooncake.store  # noqa: F401
    except (ImportError, OSError) as exc:
        raise MooncakeUnavailable(f"the Mooncake library cannot be loaded ({exc}); {_INSTALL_HINT}") from exc
    import mooncake

    return mooncake


def protocol() -> tuple[str, str]:
    """(protocol, device list) from the environment: EDGESERVE_MOONCAKE_PROTOCOL (tcp | rdma), _DEVICES."""
    proto = os.environ.get("EDGESERVE_MOONCAKE_PROTOCOL", "tcp")
    if proto not in ("tcp", "rdma"):
        raise MooncakeUnavailable(f"EDGESERVE_MOONCAKE_PROTOCOL must be tcp or rdma, not {proto!r}")
    return proto, os.environ.get("EDGESERVE_MOONCAKE_DEVICES", "")


class TransferEngineHandle:
    """One initialised Transfer Engine: its peer name and the regions registered with it.

    `register(ptr, nbytes)` registers memory once (idempotent by address);
    `write(peer, src, dst, lengths)` is one batched synchronous write of byte runs
    (addresses in this process -> addresses registered in `peer`), raising
    BackendUnavailable when the engine reports a failure."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        mc = load()
        self._engine = mc.engine.TransferEngine()
        proto, devices = protocol()
        if self._engine.initialize(f"{host}:0", "P2PHANDSHAKE", proto, devices) != 0:
            raise MooncakeUnavailable(f"the Mooncake Transfer Engine did not start on {host} ({proto})")
        self.session_id = f"{host}:{self._engine.get_rpc_port()}"
        self._registered: dict[int, int] = {}
        self._lock = threading.Lock()

    @property
    def raw(self) -> Any:
        """The library's `TransferEngine` (for a Store client sharing it)."""
        return self._engine

    def register(self, ptr: int, nbytes: int) -> None:
        """Register [ptr, ptr + nbytes). Registered regions that overlap it belonged to memory that
        has been freed since (two live allocations never overlap): they are unregistered first."""
        with self._lock:
            if self._registered.get(ptr) == nbytes:
                return
            for old, size in list(self._registered.items()):
                if old < ptr + nbytes and ptr < old + size:
                    self._engine.unregister_memory(old)
                    del self._registered[old]
            if self._engine.register_memory(ptr, nbytes) != 0:
                raise MooncakeUnavailable(f"could not register {nbytes} bytes at {ptr:#x} with the Transfer Engine")
            self._registered[ptr] = nbytes

    def write(self, peer: str, src: list[int], dst: list[int], lengths: list[int]) -> None:
        if not src:
            return
        if self._engine.batch_transfer_sync_write(peer, src, dst, lengths) != 0:
            raise BackendUnavailable(f"Mooncake write of {sum(lengths)} bytes in {len(src)} runs to {peer} failed")


def advertised_host(bind_host: str = "127.0.0.1") -> str:
    """The address peers reach this process's Transfer Engine at: EDGESERVE_MOONCAKE_HOST, else the
    worker's bind address, else (a wildcard bind) this host name's address."""
    host = os.environ.get("EDGESERVE_MOONCAKE_HOST") or bind_host
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostbyname(socket.gethostname())
    return host


_engines: dict[str, TransferEngineHandle] = {}
_engines_lock = threading.Lock()


def transfer_engine(host: str = "127.0.0.1") -> TransferEngineHandle:
    """This process's Transfer Engine on `host` (started on first use, then shared)."""
    with _engines_lock:
        if host not in _engines:
            _engines[host] = TransferEngineHandle(host)
        return _engines[host]
