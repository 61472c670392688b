"""Every Redis client edgeserve opens (gateways, workers, the admin CLI), with bounded waits.

redis-py's defaults wait 5 s to connect and 5 s per reply and retry ten times
with backoff, so a Redis that hangs (stopped, partitioned, swapping) holds a
request for many seconds. Clients made by `connect` instead:

* give up connecting after `CONNECT_TIMEOUT_S` and waiting for a reply after
  `SOCKET_TIMEOUT_S` (``redis.TimeoutError``);
* retry once, at once, only on a connection error: a pooled connection that a
  restarted Redis closed is replaced transparently, so callers recover by
  themselves when Redis returns. A timeout is not retried (it would double the wait).

`OutageLog` reports an outage once when it starts and once when it ends, not on
every failed call; `redact` names a Redis URL in logs without its password.
"""

from __future__ import annotations

import contextlib
import logging
import time
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

__all__ = ["CONNECT_TIMEOUT_S", "SOCKET_TIMEOUT_S", "connect", "redact", "OutageLog"]

CONNECT_TIMEOUT_S = 1.0
SOCKET_TIMEOUT_S = 1.0


def connect(url: str, *, max_connections: int | None = None, socket_timeout_s: float = SOCKET_TIMEOUT_S,
            connect_timeout_s: float = CONNECT_TIMEOUT_S) -> aioredis.Redis:
    """An asyncio Redis client for `url` with connect and socket timeouts; connections open lazily."""
    return aioredis.Redis.from_url(
        url, max_connections=max_connections, socket_timeout=socket_timeout_s,
        socket_connect_timeout=connect_timeout_s,
        retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)))


def redact(url: str) -> str:
    """`url` without user, password or query (``redis://:secret@host:6379/0?password=x`` -> ``redis://host:6379/0``)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    with contextlib.suppress(ValueError):
        if parts.port is not None:
            netloc += f":{parts.port}"
    if not netloc:  # unix:///path
        return f"{parts.scheme}://{parts.path}"
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


class OutageLog:
    """Logs "Redis unreachable" once per outage (with the detail) and "reachable again" when it ends."""

    def __init__(self, logger: logging.Logger, what: str = "Redis") -> None:
        self.logger, self.what = logger, what
        self.down_since: float | None = None

    def failed(self, exc: BaseException) -> None:
        """A call failed for want of Redis: log the first failure of an outage, with its detail."""
        if self.down_since is None:
            self.down_since = time.monotonic()
            self.logger.warning("%s unreachable (%s: %s); retrying until it returns", self.what,
                                type(exc).__name__, exc)

    def ok(self) -> None:
        """A call succeeded: end the outage, if there was one."""
        if self.down_since is not None:
            self.logger.warning("%s reachable again after %.1f s", self.what, time.monotonic() - self.down_since)
            self.down_since = None
