"""A gateway's local, append-only journal of usage that Redis could not take yet.

When metering cannot reach Redis, the gateway appends the unsettled entry here
and replays it when Redis returns (`gateway.metering.Meter`), so usage stays
exactly once across a Redis outage and a gateway restart. This module owns only
the file: its format, durability, locking and compaction; what an entry means
and how it is replayed idempotently is `Meter`'s.

**Where.** One file per gateway process, ``<dir>/gateway-<n>.jsonl``, the default
dir being ``$EDGESERVE_HOME/journal`` (``~/.cache/edgeserve/journal``). A gateway
takes the first file it can lock (``flock``, exclusive, held while it runs), so
several gateways on one host never share a file, and a restarted gateway takes
its old file back and replays it. `adopt_orphans` folds in unlocked files left by
gateways that no longer run. An explicit path is used as given (and locked).

**Format.** JSON lines, each ``{"key": <request id>, "entry": {...}}`` (an
unsettled entry) or ``{"key": <request id>, "settled": true}``. A key is pending
when its last entry line has no later settled line. A torn last line (a crash
mid-write) is ignored.

**Durability.** An entry line is written and fsynced before `append` returns: a
gateway killed afterwards loses nothing. Settled lines are not fsynced: losing
one only means one more replay, which the metering marker makes a no-op.

**Compaction.** Once nothing is pending, `compact` truncates the file to empty
(fsynced); the file never holds more than the lines since the last quiet moment.

File I/O blocks, so `Meter` calls these methods through `asyncio.to_thread`; a
thread lock serialises them.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
from pathlib import Path
from typing import Any, Generic, TypeVar

import msgspec

from backend.errors import EdgeServeError

__all__ = ["UsageJournal", "default_journal_dir"]

log = logging.getLogger(__name__)
E = TypeVar("E")


def default_journal_dir() -> Path:
    """``$EDGESERVE_HOME/journal`` (``~/.cache/edgeserve/journal`` by default)."""
    from ops.pull import edgeserve_home

    return edgeserve_home() / "journal"


class _Line(msgspec.Struct, omit_defaults=True):
    key: str
    entry: msgspec.Raw = msgspec.Raw(b"null")  # the entry's own JSON, decoded as the journal's type
    settled: bool = False


class UsageJournal(Generic[E]):
    """Unsettled entries of type `entry_type` (a msgspec-encodable type), keyed by request id."""

    def __init__(self, path: Path | str, entry_type: type[E]) -> None:
        """Open (creating) and lock `path`; EdgeServeError when another live process holds it."""
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a+b")  # noqa: SIM115 - held open (and locked) for the journal's life
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.close()
            raise EdgeServeError(f"usage journal {self.path} is in use by another gateway") from None
        self._decode = msgspec.json.Decoder(entry_type).decode
        self._lock = threading.Lock()
        self._pending: dict[str, E] = _read(self._file, self._decode, self.path)

    @classmethod
    def open_in(cls, directory: Path | str, entry_type: type[E]) -> UsageJournal[E]:
        """The first ``gateway-<n>.jsonl`` in `directory` that no running gateway holds."""
        for n in range(10_000):
            try:
                return cls(Path(directory) / f"gateway-{n}.jsonl", entry_type)
            except EdgeServeError:
                continue
        raise EdgeServeError(f"no free usage journal in {directory}")

    def pending(self) -> list[tuple[str, E]]:
        """Every unsettled (key, entry), oldest first."""
        with self._lock:
            return list(self._pending.items())

    def __len__(self) -> int:
        return len(self._pending)

    def append(self, key: str, entry: E) -> None:
        """Journal an unsettled entry durably (written and fsynced before this returns)."""
        line = msgspec.json.encode(_Line(key, msgspec.Raw(msgspec.json.encode(entry)))) + b"\n"
        with self._lock:
            self._file.write(line)
            self._file.flush()
            os.fsync(self._file.fileno())
            self._pending[key] = entry

    def settle(self, key: str) -> None:
        """Mark `key` settled (no fsync: a lost mark costs one idempotent replay)."""
        with self._lock:
            if self._pending.pop(key, None) is not None:
                self._file.write(msgspec.json.encode(_Line(key, settled=True)) + b"\n")
                self._file.flush()

    def compact(self) -> bool:
        """Truncate the file when nothing is pending; True when it did."""
        with self._lock:
            if self._pending or self._file.tell() == 0:
                return False
            self._file.truncate(0)
            self._file.seek(0)
            os.fsync(self._file.fileno())
            return True

    def adopt_orphans(self) -> int:
        """Move the pending entries of unlocked journals beside this one (gateways gone) into this one."""
        adopted = 0
        for other in sorted(self.path.parent.glob("gateway-*.jsonl")):
            if other == self.path:
                continue
            try:
                orphan = UsageJournal(other, object)
            except EdgeServeError:
                continue  # a running gateway's
            try:
                for key, entry in orphan.pending():
                    self.append(key, self._decode(msgspec.json.encode(entry)))
                    orphan.settle(key)
                    adopted += 1
                orphan.compact()
            finally:
                orphan.close()
        if adopted:
            log.warning("adopted %d unsettled usage entries from journals of gateways no longer running", adopted)
        return adopted

    def close(self) -> None:
        """Release the lock and close the file (pending entries stay in it for the next gateway)."""
        if not self._file.closed:
            self._file.close()


def _read(file: Any, decode: Any, path: Path) -> dict[str, Any]:
    file.seek(0)
    pending: dict[str, Any] = {}
    line_decode = msgspec.json.Decoder(_Line).decode
    data = file.read()
    for number, raw in enumerate(data.splitlines(), 1):
        try:
            line = line_decode(raw)
            if line.settled:
                pending.pop(line.key, None)
            elif bytes(line.entry) != b"null":
                pending[line.key] = decode(line.entry)
        except (msgspec.DecodeError, msgspec.ValidationError):
            log.error("usage journal %s: unreadable line %d skipped", path, number)
    if data and not data.endswith(b"\n"):  # a torn last line: later lines start on their own
        file.write(b"\n")
        file.flush()
    return pending
