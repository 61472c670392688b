"""Every Redis client edgeserve opens (gateways, workers, the admin CLI), with bounded waits.

redis-py's defaults wait 5 s to connect and 5 s per reply and retry ten times
with backoff, so a Redis that hangs (stopped, partitioned, swapping) holds a
request for many seconds. Clients made by `connect` instead:

* give up connecting after `CONNECT_TIMEOUT_S` and waiting for a reply after
  `SOCKET_TIMEOUT_S` (``redis.TimeoutError``);
* retry once, at once, only on a connection error: a pooled connection that a
  restarted Redis closed is replaced transparently, so callers recover by
  themselves when Redis returns. A timeout is not retried (it would double the wait).

Their connections (`fast_connection_class`, whatever the URL's scheme chose: TCP, TLS or a
Unix socket) also drop two costs from every command of redis-py's asyncio client, which a
gateway pays on every command it does not send on its pipelined lane (`backend/redis_lane.py`):

* commands are packed by hiredis in C, as redis-py's own synchronous client does, instead of
  its asyncio client's Python encoder (the same bytes; a 30-argument script call 28–34 → 7–10 µs);
* the write is timed by `asyncio.timeout` instead of `asyncio.wait_for`, which on Python 3.11
  starts a Task per command (15–25 µs): the same buffered `writelines`, and a `drain` that waits
  past `SOCKET_TIMEOUT_S` fails as it did (``TimeoutError``, connection dropped). The method body
  is redis-py 8.1's otherwise (pyproject pins redis to 8.x).

`OutageLog` reports an outage once when it starts and once when it ends, not on
every failed call; `redact` names a Redis URL in logs without its password.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Iterable
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.connection import HiredisRespSerializer
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.utils import HIREDIS_AVAILABLE

__all__ = ["CONNECT_TIMEOUT_S", "SOCKET_TIMEOUT_S", "connect", "fast_connection_class", "redact", "OutageLog"]

CONNECT_TIMEOUT_S = 1.0
SOCKET_TIMEOUT_S = 1.0


def connect(url: str, *, max_connections: int | None = None, socket_timeout_s: float = SOCKET_TIMEOUT_S,
            connect_timeout_s: float = CONNECT_TIMEOUT_S) -> aioredis.Redis:
    """An asyncio Redis client for `url` with connect and socket timeouts; connections open lazily."""
    client = aioredis.Redis.from_url(
        url, max_connections=max_connections, socket_timeout=socket_timeout_s,
        socket_connect_timeout=connect_timeout_s,
        retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)))
    pool = client.connection_pool
    pool.connection_class = fast_connection_class(pool.connection_class)
    return client


class _FastCommands:
    """Mixed in before a redis-py asyncio connection class (module docstring)."""

    _hiredis_packer = HiredisRespSerializer() if HIREDIS_AVAILABLE else None

    def pack_command(self, *args: object) -> list[bytes]:
        encoder = self.encoder
        if self._hiredis_packer is None or (encoder.encoding, encoder.encoding_errors) != ("utf-8", "strict"):
            return super().pack_command(*args)  # hiredis writes str as strict UTF-8 only
        return self._hiredis_packer.pack(*args)

    async def send_packed_command(self, command: bytes | str | Iterable[bytes], check_health: bool = True) -> None:
        # redis-py 8.1's body, with `asyncio.timeout` where it has `asyncio.wait_for`
        if not self.is_connected:
            await self.connect_check_health(check_health=False)
        if check_health:
            await self.check_health()
        if isinstance(command, str):
            command = command.encode()
        if isinstance(command, bytes):
            command = [command]
        try:
            async with asyncio.timeout(self.socket_timeout or None):
                self._writer.writelines(command)
                await self._writer.drain()
        except TimeoutError:
            await self.disconnect(nowait=True)
            raise RedisTimeoutError("Timeout writing to socket") from None
        except OSError as e:
            await self.disconnect(nowait=True)
            err_no, errmsg = ("UNKNOWN", e.args[0]) if len(e.args) == 1 else e.args[:2]
            raise RedisConnectionError(f"Error {err_no} while writing to socket. {errmsg}.") from e
        except BaseException:
            await self.disconnect(nowait=True)  # a half-sent command leaves the connection unusable
            raise


@functools.cache
def fast_connection_class(base: type[aioredis.Connection]) -> type[aioredis.Connection]:
    """`base` (redis-py's asyncio TCP, TLS or Unix-socket connection) with the module docstring's two
    cheaper steps per command; replies, parsing and every other behaviour are `base`'s."""
    return type(f"Fast{base.__name__}", (_FastCommands, base), {})


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
