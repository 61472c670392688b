"""backend.redis_client's connections against a real redis-server: whatever the URL's scheme, commands are
packed by hiredis and written under the reply timeout; values, errors and timeouts are redis-py's."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis
from redis.exceptions import DataError
from redis.exceptions import TimeoutError as RedisTimeoutError

from backend.redis_client import SOCKET_TIMEOUT_S, connect, fast_connection_class
from ops.redis_server import RedisServer


@pytest.mark.parametrize(("url", "base"), [("redis://127.0.0.1:1/0", aioredis.Connection),
                                           ("rediss://127.0.0.1:1/0", aioredis.SSLConnection),
                                           ("unix:///tmp/edgeserve-none.sock", aioredis.UnixDomainSocketConnection)])
def test_the_scheme_still_picks_the_transport(url: str, base: type) -> None:
    connection = connect(url).connection_pool.make_connection()
    assert isinstance(connection, base)
    assert type(connection) is fast_connection_class(base)


def test_values_round_trip_exactly_and_bad_types_fail_as_in_redis_py(redis_url: str) -> None:
    values = ["plain", "ünï\u20accode \U0001f600", b"\x00\r\n$3\r\nbinary\xff", 0, -17, 2**70, 0.1 + 0.2, 1e300,
              -0.0, ""]

    async def main() -> None:
        client = connect(redis_url)
        plain = aioredis.Redis.from_url(redis_url)  # redis-py's own packing, for comparison
        try:
            echo = client.register_script("return ARGV")
            got = await echo(keys=["k"], args=values)
            assert got == await plain.register_script("return ARGV")(keys=["k"], args=values)
            expected = [v if isinstance(v, bytes) else (repr(v) if isinstance(v, float) else str(v)).encode()
                        for v in values]
            assert got == expected
            for value, stored in zip(values, expected, strict=True):
                await client.set("v", value)
                assert await plain.get("v") == stored
            assert await client.execute_command("CONFIG GET", "maxmemory")  # a command name with a space
            with pytest.raises(DataError):
                await client.set("v", True)
            with pytest.raises(DataError):
                await plain.set("v", True)
            async with client.pipeline(transaction=True) as pipe:
                pipe.incrby("n", 2).incrby("n", 3).get("n")
                assert await pipe.execute() == [2, 5, b"5"]
        finally:
            await client.aclose()
            await plain.aclose()
    asyncio.run(main())


def test_a_write_redis_never_takes_times_out_and_the_client_recovers(restartable_redis: RedisServer) -> None:
    async def main() -> None:
        client = connect(restartable_redis.url)
        try:
            await client.set("small", "1")
            big = b"x" * (64 * 2**20)  # more than the socket buffers of both ends hold
            restartable_redis.pause()
            started = time.monotonic()
            with pytest.raises(RedisTimeoutError, match="writing to socket"):
                await client.set("big", big)
            assert time.monotonic() - started < SOCKET_TIMEOUT_S + 2.0
            restartable_redis.resume()
            assert await client.get("small") == b"1"  # the half-written connection was dropped, not reused
        finally:
            restartable_redis.resume()
            await client.aclose()
    asyncio.run(main())
