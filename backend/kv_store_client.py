"""A worker's client of the cluster's Mooncake Store: connect in the background, then exists / get / put.

Mooncake Store (`mooncake_master` plus the clients) keeps objects in memory that the
clients contribute: each client mounts a segment of `segment_bytes` of its own
memory into the cluster's pool, and the master decides where each object lives and
evicts the least recently used when the pool fills. So a worker both serves and
uses the store; an object lives as long as the worker whose segment holds it (and
until evicted). Peers reach this client's segment at `host` (the worker's advertised
address), over TCP, or RDMA with EDGESERVE_MOONCAKE_PROTOCOL=rdma (`mooncake_runtime`).

Timing and the GIL, measured here (loopback, 2 cores). `setup` holds the GIL for as long
as it takes (the whole process stops); the object calls release it. With the library's
defaults `setup` against a dead master retries for ~90 s, and every call blocks up to 30 s
against a hung one (SIGSTOP). So this client
- sets, unless the environment does, MC_STORE_CLIENT_SETUP_RETRIES=1, MC_RPC_TIMEOUT_MS=1000
  and MC_RPC_CONNECT_TIMEOUT_MS=1000 (master RPCs only; the data moves over the transfer
  engine): a hung master then costs a call ~1 s, off the engine thread;
- connects on a daemon thread, and calls `setup` only after a plain TCP connect to the
  master succeeded within 1 s (no GIL held): a dead or black-holed master never reaches
  `setup`. A master that accepts connections but does not answer still costs one `setup`
  (~1 s with the GIL held) per attempt; attempts back off from 2 s to 60 s. Until
  connected the client is not `ready` and the worker serves without its store;
- with the master killed, `batch_is_exist` and `get_batch` answer an error at once;
- `get_batch` of 64 objects of 700 kB takes ~70 ms; `batch_get_into` registered buffers
  was slower here (~150 ms), so the tier uses `get_batch`.

Failures are `MooncakeUnavailable` (= BackendUnavailable); they never reach a request:
the tier counts them and recomputes.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

from backend.errors import InvalidRequest
from backend.mooncake_runtime import MooncakeUnavailable, load, protocol

__all__ = ["MooncakeStoreClient", "parse_master_address", "LIBRARY_DEFAULTS"]

log = logging.getLogger(__name__)

# environment the library reads when a client is set up (setdefault: an operator's own values win)
LIBRARY_DEFAULTS = {"MC_STORE_CLIENT_SETUP_RETRIES": "1", "MC_RPC_TIMEOUT_MS": "1000",
                    "MC_RPC_CONNECT_TIMEOUT_MS": "1000"}
PROBE_TIMEOUT_S = 1.0
RETRY_S = (2.0, 60.0)  # first and longest wait between connection attempts


def parse_master_address(address: str) -> tuple[str, int]:
    """'host:port' -> (host, port), or InvalidRequest."""
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidRequest(f"a Mooncake master address is host:port (e.g. 127.0.0.1:50051), not {address!r}")
    return host.strip("[]"), int(port)


class MooncakeStoreClient:
    """One connection to a Mooncake master (thread-safe calls; `ready` once connected).

    `exists(keys)` -> list[bool]; `get(keys)` -> list[bytes] (b"" for a missing key);
    `put(keys, values)`; `remove(key)` (forced). Each raises MooncakeUnavailable when the library
    reports an error, or when it is not connected yet."""

    def __init__(self, master: str, host: str = "127.0.0.1", segment_bytes: int = 512 << 20,
                 buffer_bytes: int = 128 << 20) -> None:
        self._address = parse_master_address(master)
        self.master, self.host = master, host
        self.segment_bytes, self.buffer_bytes = segment_bytes, buffer_bytes
        self._mc = load()  # raises MooncakeUnavailable (with the install hint) before any thread starts
        self._store: Any = None
        self._ready = threading.Event()
        self.failure: str | None = None  # why the last connection attempt failed
        self.attempts = 0  # `setup` calls so far
        self._closed = False
        self._thread = threading.Thread(target=self._connect, name="edgeserve-kv-store-connect", daemon=True)
        self._thread.start()

    def _probe(self) -> bool:
        """A TCP connect to the master within PROBE_TIMEOUT_S (the GIL is free meanwhile)."""
        try:
            socket.create_connection(self._address, timeout=PROBE_TIMEOUT_S).close()
            return True
        except OSError as exc:
            self.failure = f"master not reachable: {exc}"
            return False

    def _connect(self) -> None:
        for name, value in LIBRARY_DEFAULTS.items():
            os.environ.setdefault(name, value)
        proto, devices = protocol()
        wait, warned = RETRY_S[0], False
        while not self._closed:
            if self._probe():
                store = self._mc.store.MooncakeDistributedStore()
                self.attempts += 1
                try:
                    rc = store.setup(self.host, "P2PHANDSHAKE", self.segment_bytes, self.buffer_bytes, proto,
                                     devices, self.master)
                    why = f"setup returned {rc}"
                except Exception as exc:  # noqa: BLE001 - the worker serves on without its store
                    rc, why = -1, f"{type(exc).__name__}: {exc}"
                if rc == 0:
                    self._store, self.failure = store, None
                    self._ready.set()
                    log.info("KV store: connected to the Mooncake master at %s (segment %d MiB)", self.master,
                             self.segment_bytes >> 20)
                    return
                self.failure = why
            if not warned:
                log.warning("KV store: cannot connect to the Mooncake master at %s (%s); prompts are recomputed "
                            "meanwhile, retrying", self.master, self.failure)
                warned = True
            time.sleep(wait)
            wait = min(wait * 2, RETRY_S[1])

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and not self._closed

    def wait_attempt(self, timeout_s: float) -> bool:
        """Block until connected or one connection attempt has failed; False if neither within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._ready.is_set() or self.failure is not None:
                return True
            time.sleep(0.01)
        return False

    def wait_ready(self, timeout_s: float) -> bool:
        """Block until connected (True) or `timeout_s` passed (False)."""
        return self._ready.wait(timeout_s) and not self._closed

    def _check(self) -> None:
        if not self.ready:
            raise MooncakeUnavailable(f"the KV store at {self.master} is not connected"
                                      + (f" ({self.failure})" if self.failure else ""))

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self._check()
        codes = self._store.batch_is_exist(list(keys))
        bad = [c for c in codes if c < 0]
        if bad:
            raise MooncakeUnavailable(f"the KV store at {self.master} answered error {bad[0]} to an existence query")
        return [c == 1 for c in codes]

    def get(self, keys: Sequence[str]) -> list[bytes]:
        self._check()
        return self._store.get_batch(list(keys))

    def put(self, keys: Sequence[str], values: Sequence[bytes]) -> None:
        self._check()
        rc = self._store.put_batch(list(keys), list(values))
        if rc != 0:
            raise MooncakeUnavailable(f"the KV store at {self.master} refused a put of {len(keys)} objects ({rc})")

    def remove(self, key: str) -> bool:
        """Remove `key` even while a reader's lease on it runs (a plain remove is refused for seconds after
        any get); False when the store refused."""
        self._check()
        return self._store.remove(key, True) == 0

    def close(self) -> None:
        """Unmount this client's segment (its objects go) and disconnect, on a daemon thread: against a
        dead master the library retries for seconds, which must not hold up a worker's exit."""
        if self._closed:
            return
        self._closed = True
        if self._ready.is_set():
            threading.Thread(target=self._store.close, name="edgeserve-kv-store-close", daemon=True).start()
