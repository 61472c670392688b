"""Reads cached in this process and kept exact by Redis: server-assisted client-side caching.

A gateway reads the same few keys on every request: an API token's lookup and its tenant's
record (`gateway.tenants`). They change rarely (a key created or revoked, a quota set), and a
stale answer is a security bug (a revoked key must stop working at once), so a time-to-live
cache is the wrong tool. Redis's client tracking (6.0 on) is the right one: Redis remembers
which keys a connection read and sends it an ``invalidate`` message as soon as anyone writes
one of them. `TrackedReads` keeps a reply until then:

* **One ordered stream.** The tracked reads and the invalidations share one RESP3 connection
  (``HELLO 3``; a `backend.redis_lane` connection). A reply is stored the moment it is parsed,
  before its caller resumes, and an invalidation drops its key the moment it is parsed, so the
  cache holds what Redis held when it sent the last byte read so far: a write Redis ran before
  a read is in that read's reply, and one it ran after is invalidated after the reply.
* **Opt-in** (``CLIENT TRACKING ON OPTIN``): Redis tracks only a read sent right after
  ``CLIENT CACHING YES`` (the two leave in one write), and the reply is kept only when that
  command succeeded. Callers choose what is tracked: the tenant store tracks a token only once
  it has authenticated, so a client sending random tokens makes Redis remember nothing.
* **Fresh or nothing.** Invalidations need the connection. When it closes, times out or is
  replaced, every entry is dropped. A PING every `PING_INTERVAL_S` keeps bytes coming, and
  entries are served only while something arrived within `STALE_AFTER_S`: a partition that
  leaves the socket open (no close, no invalidations) stops the cache within that bound (and the
  connection's reply timeout closes it soon after).
* **Bounded.** At most `max_keys` keys here (all dropped when full). Redis bounds its own side
  (``tracking-table-max-keys``; a key it evicts from the table is invalidated).

Where Redis cannot track (before 6.0: ``HELLO 3`` refused) or the client has no lane (TLS),
every read is a plain one, through `backend.redis_lane.run_command`: same answers, no cache.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import hiredis

from backend.redis_lane import RedisLane, SetupRefused, lane_for, retrieve_exception, run_command

if TYPE_CHECKING:
    import redis.asyncio

    from backend.redis_lane import _Connection

__all__ = ["TrackedReads", "MISS", "PING_INTERVAL_S", "STALE_AFTER_S"]

log = logging.getLogger(__name__)

PING_INTERVAL_S = 0.5
STALE_AFTER_S = 1.5  # serve entries only while Redis was heard from this recently
MISS: Any = object()  # `TrackedReads.get`'s answer for a read it does not hold

_CACHING = object()  # the tag of a read's CLIENT CACHING YES
_CACHING_YES = hiredis.pack_command(("CLIENT", "CACHING", "YES"))
_PING = hiredis.pack_command(("PING",))
Command = tuple[str, ...]


class TrackedReads:
    """Replies to reads of single keys, cached until Redis says the key changed (module docstring)."""

    def __init__(self, client: redis.asyncio.Redis, *, max_keys: int = 100_000,
                 ping_interval_s: float = PING_INTERVAL_S, stale_after_s: float = STALE_AFTER_S) -> None:
        """Reads go to `client`'s Redis; its address, credentials, database and timeouts apply."""
        self._client = client
        self._lane: RedisLane | None = None if lane_for(client) is None else RedisLane(
            client, listener=self, setup=[("HELLO", "3"), ("CLIENT", "TRACKING", "ON", "OPTIN")])
        self._max_keys, self._ping_interval_s, self._stale_after_s = max_keys, ping_interval_s, stale_after_s
        self._entries: dict[str, dict[Command, Any]] = {}  # key -> read -> its (parsed) reply
        self._conn: _Connection | None = None  # the connection the entries came from
        self._heard = -math.inf  # monotonic time bytes last came on it
        self._armed = False  # the last CLIENT CACHING YES succeeded: the next tagged read is tracked
        self._pinger: asyncio.TimerHandle | None = None

    @property
    def enabled(self) -> bool:
        """Whether reads may be cached (False for a TLS client, or a Redis that refused tracking)."""
        return self._lane is not None

    def get(self, key: str, command: Command) -> Any:
        """The cached (parsed) reply of `command`, a read of `key`; `MISS` when not held or not fresh."""
        per_key = self._entries.get(key)
        if per_key is None:
            return MISS
        if time.monotonic() - self._heard > self._stale_after_s:
            self._entries.clear()
            return MISS
        return per_key.get(command, MISS)

    async def read(self, key: str, command: Command, *, track: bool = True,
                   parse: Callable[[Any], Any] | None = None) -> Any:
        """`command`'s reply, passed through `parse`; `command` must read `key` and nothing else. Sent
        tracked, and its reply kept, when `track` and tracking is available; otherwise a plain read.
        Raises redis-py's errors, as `run_command` does."""
        lane = self._lane
        if track and lane is not None:
            try:
                conn = await lane.connection()
            except SetupRefused as exc:
                log.warning("Redis does not support client tracking (%s); reads are not cached", exc)
                self._lane = None
                await lane.aclose()
            else:
                if conn is not self._conn:
                    self._adopt(conn)
                caching, reply = conn.send_many(_CACHING_YES + hiredis.pack_command(command), 2,
                                                (_CACHING, (key, command, parse)))
                caching.add_done_callback(retrieve_exception)
                return await reply
        value = await run_command(self._client, *command)
        return value if parse is None else parse(value)

    async def aclose(self) -> None:
        """Close the tracking connection; the entries go with it."""
        self._drop(self._conn)
        if self._lane is not None:
            await self._lane.aclose()

    # The connection's listener (`backend.redis_lane.ReplyListener`), called in stream order.

    def received(self, conn: _Connection) -> None:
        if conn is self._conn:
            self._heard = time.monotonic()

    def pushed(self, conn: _Connection, message: list[Any]) -> None:
        if conn is not self._conn or not message or message[0] != b"invalidate":
            return
        keys = message[1] if len(message) > 1 else None
        if keys is None:  # FLUSHDB, FLUSHALL, or Redis forgot what it tracked: everything
            self._entries.clear()
            return
        for key in keys:
            self._entries.pop(key.decode() if isinstance(key, bytes) else key, None)

    def replied(self, conn: _Connection, tag: Any, reply: Any) -> Any:
        if tag is _CACHING:
            self._armed = True
            return reply
        key, command, parse = tag
        value = reply if parse is None else parse(reply)
        if self._armed and conn is self._conn:
            if key not in self._entries and len(self._entries) >= self._max_keys:
                self._entries.clear()
            self._entries.setdefault(key, {})[command] = value
        self._armed = False
        return value

    def closed(self, conn: _Connection) -> None:
        self._drop(conn)

    def _adopt(self, conn: _Connection) -> None:
        """`conn` is the lane's new connection: nothing read on an older one is kept."""
        self._drop(self._conn)
        self._conn, self._heard, self._armed = conn, time.monotonic(), False
        self._pinger = asyncio.get_running_loop().call_later(self._ping_interval_s, self._ping)

    def _drop(self, conn: _Connection | None) -> None:
        if conn is None or conn is not self._conn:
            return
        self._entries.clear()
        self._conn, self._armed = None, False
        if self._pinger is not None:
            self._pinger.cancel()
            self._pinger = None

    def _ping(self) -> None:
        conn = self._conn
        if conn is None or conn.closed or conn.transport.is_closing():
            self._drop(conn)
            return
        conn.send(_PING).add_done_callback(retrieve_exception)
        self._pinger = asyncio.get_running_loop().call_later(self._ping_interval_s, self._ping)
