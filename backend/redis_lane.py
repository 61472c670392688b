"""One pipelined Redis connection for the gateway's per-request commands: quota admission, metering,
the router's prefix-index lookups and token lookups the tracked reads do not hold
(`backend.redis_tracking`, whose own connection is a lane with a listener).

redis-py's asyncio client takes a connection from its pool for every command, and gives it
back after the reply: a lock, two `asyncio.timeout` scopes, its retry and event wrappers and
an observability hook per command. Measured on a 2-core VM against a local redis-server
(3,000 awaited calls, two passes), one HGET cost the calling process 100-138 µs of CPU through
`backend.redis_client.connect`'s client and 39-55 µs on a lane, a script call 123-145 against
44-58; a gateway sends two or three such commands per request. A `RedisLane` is that straight path
(redis-py has no multiplexed asyncio connection), kept correct:

* **Pipelined.** Every command goes out on the one connection as soon as it is called, and
  replies come back in order (RESP guarantees it), each to the future that sent it. Any number
  of coroutines share it; a caller cancelled while waiting leaves its future in the queue, so
  its reply is read and dropped, and the connection stays usable (redis-py must drop it).
* **Bounded waits.** Connecting gives up after `CONNECT_TIMEOUT_S`. A reply that has not come
  `SOCKET_TIMEOUT_S` after its command was sent fails it and every command behind it with
  redis-py's ``TimeoutError``, and closes the connection (checked by one timer per connection,
  not one per command). A closed connection fails what is in flight with ``ConnectionError``;
  the next call connects again, so a restarted Redis is picked up by itself. Nothing is sent
  twice: a command that may have reached Redis is never retried (the scripts are not idempotent).
* **Redis-py's errors.** Error replies raise ``ResponseError`` (``NoScriptError`` for
  NOSCRIPT), failures ``ConnectionError`` / ``TimeoutError`` from ``redis.exceptions``, so
  `gateway.redis_keys.redis_errors` maps them to the same typed errors as before.
* **Pipelines** (`execute_many`: the router's prefix-index lookups) leave in one write.
* **Scripts** go as EVALSHA of redis-py's registered `Script` object; on NOSCRIPT (a restarted
  or flushed Redis) the same call goes again as EVAL, which runs it and caches it.

The connection speaks RESP2 (RESP3 where the caller's setup sends ``HELLO 3``, as the tracked
reads do) to the URL's host and port (or Unix socket), sends AUTH and SELECT as the URL asks, and
returns raw bytes, as the gateway's clients do. ``rediss://`` (TLS) URLs
get no lane (`lane_for` returns None) and their callers use redis-py's client.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import hiredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from backend.redis_client import CONNECT_TIMEOUT_S, SOCKET_TIMEOUT_S

if TYPE_CHECKING:
    import redis.asyncio
    from redis.commands.core import AsyncScript

__all__ = ["RedisLane", "ReplyListener", "SetupRefused", "lane_for", "retrieve_exception", "run_command",
           "run_pipeline", "run_script"]


class SetupRefused(RedisConnectionError):
    """Redis answered a connection's setup command (AUTH, SELECT, or the caller's own) with an error."""


class ReplyListener(Protocol):
    """What a connection tells its owner besides the replies it hands out (`backend.redis_tracking`), all
    in the order the bytes came: every chunk received, RESP3 push messages, and each tagged command's reply
    (a tag is the caller's, given with the command: the reply is seen here before its caller resumes)."""

    def received(self, conn: _Connection) -> None: ...
    def pushed(self, conn: _Connection, message: list[Any]) -> None: ...
    def replied(self, conn: _Connection, tag: Any, reply: Any) -> Any: ...  # what the caller gets
    def closed(self, conn: _Connection) -> None: ...


def retrieve_exception(future: asyncio.Future[Any]) -> None:
    """Mark a done future's exception as seen (a done callback for futures nobody awaits), so a failure
    nobody waited for leaves no "exception was never retrieved" behind."""
    if not future.cancelled():
        future.exception()


def _reply_error(message: str) -> ResponseError:
    return NoScriptError(message) if message.startswith("NOSCRIPT") else ResponseError(message)


class _Connection(asyncio.Protocol):
    """One socket: commands written in call order, replies handed out in the same order."""

    def __init__(self, timeout_s: float, listener: ReplyListener | None = None) -> None:
        self.timeout_s = timeout_s
        self.listener = listener
        self.transport: asyncio.Transport | None = None
        self.reader = hiredis.Reader(replyError=_reply_error)
        # (the caller's future, when sent, the listener's tag or None), in the order sent
        self.waiting: collections.deque[tuple[asyncio.Future[Any], float, Any]] = collections.deque()
        self.closed = False
        self._watch: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self, packed: bytes) -> asyncio.Future[Any]:
        return self.send_many(packed, 1)[0]

    def send_many(self, packed: bytes, count: int, tags: Sequence[Any] = ()) -> list[asyncio.Future[Any]]:
        """`count` commands packed together: one write, a future per reply; `tags` (if any, one per
        command, None for none) go with the replies to the listener."""
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        if self.transport.is_closing():  # `RedisLane._ready` does not hand out such a connection
            raise RedisConnectionError("the connection to Redis is closing")
        futures = [loop.create_future() for _ in range(count)]
        if tags:
            self.waiting.extend((future, now, tag) for future, tag in zip(futures, tags, strict=True))
        else:
            self.waiting.extend((future, now, None) for future in futures)
        self.transport.write(packed)
        if self._watch is None:
            self._watch = loop.call_later(self.timeout_s / 4, self._check_overdue)
        return futures

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        waiting, listener = self.waiting, self.listener
        if listener is not None:
            listener.received(self)
        while (reply := self.reader.gets()) is not False:
            if listener is not None and type(reply) is hiredis.PushNotification:
                listener.pushed(self, reply)
                continue
            if not waiting:  # a reply nobody asked for: the stream is out of step, never trust it again
                self.fail(RedisConnectionError("Redis sent a reply to no command"))
                return
            future, _, tag = waiting.popleft()
            if tag is not None and not isinstance(reply, ResponseError):
                reply = listener.replied(self, tag, reply)
            if future.done():  # its caller was cancelled: the reply is read and dropped
                continue
            if isinstance(reply, ResponseError):
                future.set_exception(reply)
            else:
                future.set_result(reply)

    def _check_overdue(self) -> None:
        self._watch = None
        if self.closed or not self.waiting:
            return
        overdue = time.monotonic() - self.waiting[0][1] - self.timeout_s
        if overdue >= 0:
            self.fail(RedisTimeoutError(f"no reply from Redis within {self.timeout_s:g} s"))
            return
        self._watch = asyncio.get_running_loop().call_later(min(-overdue, self.timeout_s / 4) + 1e-3,
                                                            self._check_overdue)

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(RedisConnectionError(f"Redis closed the connection{f': {exc}' if exc else ''}"))

    def fail(self, exc: Exception) -> None:
        """Close, failing every command still waiting with `exc`."""
        if not self.closed and self.listener is not None:
            self.listener.closed(self)
        self.closed = True
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        while self.waiting:
            future = self.waiting.popleft()[0]
            if not future.done():
                future.set_exception(exc)
                future.exception()  # a caller that left must not leave "never retrieved" behind
        if self.transport is not None:
            self.transport.close()


class RedisLane:
    """Commands and scripts on one pipelined connection to `client`'s Redis (module docstring)."""

    def __init__(self, client: redis.asyncio.Redis, timeout_s: float | None = None,
                 connect_timeout_s: float | None = None, *, listener: ReplyListener | None = None,
                 setup: Sequence[tuple[str | int, ...]] = ()) -> None:
        """`client`'s address, credentials and database; its socket timeouts unless given (else the defaults).
        Each new connection reports to `listener` and sends `setup` after AUTH and SELECT (an error reply:
        `SetupRefused`)."""
        kwargs = client.connection_pool.connection_kwargs
        self._path: str | None = kwargs.get("path")
        self._host, self._port = kwargs.get("host", "localhost"), int(kwargs.get("port", 6379))
        self._setup: list[tuple[Any, ...]] = []
        if kwargs.get("password") is not None:
            user = kwargs.get("username")
            self._setup.append(("AUTH", *((user,) if user else ()), kwargs["password"]))
        if int(kwargs.get("db") or 0):
            self._setup.append(("SELECT", int(kwargs["db"])))
        self._setup.extend(setup)
        self._listener = listener
        self._timeout_s = timeout_s or kwargs.get("socket_timeout") or SOCKET_TIMEOUT_S
        self._connect_timeout_s = connect_timeout_s or kwargs.get("socket_connect_timeout") or CONNECT_TIMEOUT_S
        self._conn: _Connection | None = None
        self._connecting: asyncio.Future[_Connection] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def execute(self, *args: str | bytes | int | float) -> Any:
        """One command's reply (bytes, int, a list of them, or None)."""
        packed = hiredis.pack_command(args)
        return await (await self._ready()).send(packed)

    async def execute_many(self, commands: list[tuple[str | bytes | int | float, ...]]) -> list[Any]:
        """Every command's reply, in order, the commands sent in one write (a pipeline without MULTI); an
        error reply raises, as redis-py's `pipeline().execute()` does, once all replies are in."""
        if not commands:
            return []
        packed = b"".join(hiredis.pack_command(c) for c in commands)
        conn = await self._ready()
        replies = await asyncio.gather(*conn.send_many(packed, len(commands)), return_exceptions=True)
        for reply in replies:
            if isinstance(reply, BaseException):
                raise reply
        return replies

    async def script(self, script: AsyncScript, keys: list[str], args: list[str | bytes | int | float]) -> Any:
        """Run redis-py's registered `script` (EVALSHA; EVAL when Redis does not have it cached)."""
        try:
            return await self.execute("EVALSHA", script.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await self.execute("EVAL", script.script, len(keys), *keys, *args)

    async def connection(self) -> _Connection:
        """The open connection (connecting if need be), for a caller that sends on it itself: tagged
        commands, or several that must leave in one write (`backend.redis_tracking`)."""
        return await self._ready()

    async def aclose(self) -> None:
        """Close the connection (commands in flight fail); the next call opens a new one."""
        if self._conn is not None and not self._conn.closed:
            self._conn.fail(RedisConnectionError("the lane was closed"))
        self._conn = None

    async def _ready(self) -> _Connection:
        """The open connection, or a new one (also when Redis's close has not been delivered yet: nothing of
        this command was sent, so it goes on the new one)."""
        conn = self._conn
        if conn is None or conn.closed or conn.transport.is_closing() or self._loop is not asyncio.get_running_loop():
            conn = await self._connected()
        return conn

    async def _connected(self) -> _Connection:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # first use, or a new event loop: nothing of the old one carries over
            if self._conn is not None and self._conn.transport is not None:
                with contextlib.suppress(Exception):  # its loop may be closed already
                    self._conn.transport.abort()
            self._loop, self._conn, self._connecting = loop, None, None
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect())
        connecting = self._connecting
        try:
            conn = await asyncio.shield(connecting)
        finally:
            if connecting.done() and self._connecting is connecting:
                self._connecting = None
        self._conn = conn
        return conn

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        conn: _Connection | None = None
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                factory = lambda: _Connection(self._timeout_s, self._listener)  # noqa: E731
                if self._path is not None:
                    _, conn = await loop.create_unix_connection(factory, self._path)
                else:
                    _, conn = await loop.create_connection(factory, self._host, self._port)
                for command in self._setup:
                    try:
                        await conn.send(hiredis.pack_command(command))
                    except ResponseError as exc:  # never the command itself: it may hold the password
                        raise SetupRefused(f"Redis refused {command[0]}: {exc}") from None
        except BaseException as exc:
            if conn is not None:
                conn.fail(RedisConnectionError("connecting failed"))
            if isinstance(exc, TimeoutError):
                raise RedisTimeoutError(f"connecting to Redis took over {self._connect_timeout_s:g} s") from None
            if isinstance(exc, OSError):
                raise RedisConnectionError(f"cannot connect to Redis: {exc}") from exc
            raise
        return conn


_lanes: weakref.WeakKeyDictionary[Any, RedisLane | None] = weakref.WeakKeyDictionary()


def lane_for(client: redis.asyncio.Redis) -> RedisLane | None:
    """The lane shared by everything that uses `client` (made on first use); None for a TLS client."""
    try:
        return _lanes[client]
    except KeyError:
        kwargs = client.connection_pool.connection_kwargs
        tls = "ssl" in client.connection_pool.connection_class.__name__.lower() or any(
            k.startswith("ssl_") for k in kwargs)
        lane = _lanes[client] = None if tls else RedisLane(client)
        return lane


async def run_command(client: redis.asyncio.Redis, *args: str | bytes | int | float) -> Any:
    """One command on `client`'s lane (through redis-py where it has none)."""
    lane = lane_for(client)
    if lane is None:
        return await client.execute_command(*args)
    return await lane.execute(*args)


async def run_pipeline(client: redis.asyncio.Redis, commands: list[tuple[str | bytes | int | float, ...]]
                       ) -> list[Any]:
    """`commands` in one write on `client`'s lane, their replies in order (a redis-py pipeline, without
    MULTI, where it has none); an error reply raises."""
    lane = lane_for(client)
    if lane is not None:
        return await lane.execute_many(commands)
    pipe = client.pipeline(transaction=False)
    for command in commands:
        pipe.execute_command(*command)
    return await pipe.execute()


async def run_script(client: redis.asyncio.Redis, script: AsyncScript, keys: list[str],
                     args: list[str | bytes | int | float]) -> Any:
    """redis-py's registered `script` on `client`'s lane (through redis-py where it has none)."""
    lane = lane_for(client)
    if lane is None:
        return await script(keys=keys, args=args)
    return await lane.script(script, keys, args)
