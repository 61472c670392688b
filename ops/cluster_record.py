"""The running local cluster's record: what `edgeserve up` started, for the commands that follow.

`up` writes `<home>/cluster.json` (home: `$EDGESERVE_HOME`, else ~/.cache/edgeserve)
when its worker is ready and its gateway is about to listen, and removes it when it
stops. `edgeserve tenant`, `edgeserve key` and `edgeserve chat` read it when no flag
or environment variable says otherwise, so they reach the Redis that `up` started on
a random port, and `chat` talks to its gateway with the demo tenant's token.

The file holds the Redis URL (which may carry a password) and that API token, so it
is written with mode 0600, atomically (a temporary file renamed over it).

A record whose `up` process is gone is stale: `running_cluster` ignores it, says so
in one line on stderr, and deletes it. The process is matched by pid and its start
time, so a reused pid does not revive a record.

Every setting resolves in one order (`setting`): an explicit flag, then the
environment variable, then the record, then the built-in default.
"""

from __future__ import annotations

import contextlib
import os
import sys
from datetime import UTC, datetime
from pathlib import Path

import msgspec

__all__ = ["ClusterRecord", "record_path", "process_start_time", "new_record", "write_record", "remove_record",
           "read_record", "is_running", "running_cluster", "setting"]

RECORD_NAME = "cluster.json"


class ClusterRecord(msgspec.Struct, frozen=True):
    """What one `edgeserve up` runs; every URL is reachable from this machine."""

    gateway_url: str
    redis_url: str  # may carry a password: the file is 0600
    worker_urls: list[str]
    pid: int  # the `up` process, which runs the gateway
    pid_started: int  # start time of `pid` (clock ticks after boot, /proc/<pid>/stat field 22)
    worker_pids: list[int]
    started_at: str  # ISO 8601, UTC
    model: str  # the name clients ask for
    tenant_id: str  # the demo tenant
    token: str  # the demo tenant's API token, so `edgeserve chat` works with no flags
    kv_store: str = ""  # the KV store's Mooncake master ("host:port"; `up --kv-store`), "" without one


def record_path(home: Path | None = None) -> Path:
    """`<home>/cluster.json`."""
    from ops.pull import edgeserve_home

    return (home if home is not None else edgeserve_home()) / RECORD_NAME


def process_start_time(pid: int) -> int | None:
    """When `pid` started (clock ticks after boot), or None when no such process exists."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # fields after "(comm)" start at field 3; starttime is 22


def new_record(*, gateway_url: str, redis_url: str, worker_urls: list[str], worker_pids: list[int], model: str,
               tenant_id: str, token: str, kv_store: str = "") -> ClusterRecord:
    """The record of the cluster this process runs, stamped with its pid and the time."""
    pid = os.getpid()
    return ClusterRecord(gateway_url=gateway_url, redis_url=redis_url, worker_urls=worker_urls, pid=pid,
                         pid_started=process_start_time(pid) or 0, worker_pids=worker_pids,
                         started_at=datetime.now(UTC).isoformat(timespec="seconds"), model=model,
                         tenant_id=tenant_id, token=token, kv_store=kv_store)


def write_record(record: ClusterRecord, home: Path | None = None) -> Path:
    """Write `record` (mode 0600, atomically) and return its path."""
    path = record_path(home)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(msgspec.json.format(msgspec.json.encode(record)) + b"\n")
    os.replace(tmp, path)
    return path


def read_record(home: Path | None = None) -> ClusterRecord | None:
    """The record as written, running or not; None when there is none or it cannot be read."""
    try:
        return msgspec.json.decode(record_path(home).read_bytes(), type=ClusterRecord)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None


def remove_record(home: Path | None = None, *, pid: int | None = None) -> None:
    """Delete the record; with `pid`, only if that process wrote it (another `up` may have replaced it)."""
    record = read_record(home)
    if pid is None or (record is not None and record.pid == pid):
        with contextlib.suppress(FileNotFoundError):
            record_path(home).unlink()


def is_running(record: ClusterRecord) -> bool:
    """Whether the `up` process that wrote `record` is still the one alive under its pid."""
    return process_start_time(record.pid) == record.pid_started


def running_cluster(home: Path | None = None) -> ClusterRecord | None:
    """The record of a cluster that is running now; a stale one is reported on stderr, removed, and ignored."""
    record = read_record(home)
    if record is None or is_running(record):
        return record
    print(f"edgeserve: ignoring the record of a cluster that is no longer running (pid {record.pid}, started "
          f"{record.started_at}); removed {record_path(home)}", file=sys.stderr)
    remove_record(home, pid=record.pid)
    return None


def setting(flag: str | None, env_var: str | None, field: str, default: str | None) -> str | None:
    """A setting: the `flag` if given, else `$env_var`, else the running cluster's `field`, else `default`."""
    if flag:
        return flag
    if env_var and os.environ.get(env_var):
        return os.environ[env_var]
    record = running_cluster()
    return getattr(record, field) if record is not None else default
