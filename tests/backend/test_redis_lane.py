"""`backend.redis_lane` against a real redis-server: pipelined replies reach the callers that sent them,
errors and scripts behave as through redis-py, a cancelled caller leaves the connection usable, a hung
Redis times out and a restarted one is reconnected to, and the URL's password and database apply."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from backend.redis_client import connect
from backend.redis_lane import RedisLane, lane_for, run_command, run_pipeline, run_script
from ops.redis_server import RedisServer


def test_concurrent_callers_each_get_their_own_reply_in_call_order(redis_url: str) -> None:
    async def main() -> None:
        client = connect(redis_url)
        lane = lane_for(client)
        assert lane is not None and lane_for(client) is lane  # one lane per client
        rng = random.Random()
        values = {f"k{i}": rng.randbytes(rng.randint(0, 300)) for i in range(50)}
        for key, value in values.items():
            await client.set(key, value)
        keys = list(values) * 4
        rng.shuffle(keys)
        got = await asyncio.gather(*(lane.execute("GET", k) for k in keys))
        assert got == [values[k] for k in keys]
        counts = await asyncio.gather(*(lane.execute("INCR", "n") for _ in range(200)))
        assert counts == list(range(1, 201))  # sent in call order, answered in that order
        assert await run_command(client, "HGET", "missing", "f") is None
        await lane.aclose()
        await client.aclose()

    asyncio.run(main())


def test_errors_and_scripts_behave_as_through_redis_py(redis_url: str) -> None:
    async def main() -> None:
        client = connect(redis_url)
        lane = lane_for(client)
        await client.set("text", "x")
        with pytest.raises(ResponseError, match="WRONGTYPE"):
            await lane.execute("LPUSH", "text", "y")
        assert await lane.execute("GET", "text") == b"x"  # the connection is still in step after an error
        script = client.register_script("return {KEYS[1], ARGV[1], tonumber(ARGV[2]) + 1}")
        args = ["a", random.randint(0, 10**6)]
        assert await run_script(client, script, ["key"], args) == await script(keys=["key"], args=args)
        await client.script_flush()  # as after a Redis restart: EVALSHA answers NOSCRIPT, EVAL runs it
        assert await lane.script(script, ["key"], args) == [b"key", b"a", args[1] + 1]
        assert await client.script_exists(script.sha) == [True]
        await lane.aclose()
        await client.aclose()

    asyncio.run(main())


def test_a_cancelled_caller_leaves_the_connection_in_step(redis_url: str) -> None:
    async def main() -> None:
        client = connect(redis_url)
        lane = lane_for(client)
        await client.set("after", "fine")
        blocked = asyncio.ensure_future(lane.execute("BLPOP", "never-pushed", "0.3"))
        await asyncio.sleep(0.05)
        blocked.cancel()
        with pytest.raises(asyncio.CancelledError):
            await blocked
        assert await lane.execute("GET", "after") == b"fine"  # not BLPOP's nil
        await lane.aclose()
        await client.aclose()

    asyncio.run(main())


def test_a_closing_connection_is_not_written_to(redis_url: str) -> None:
    """A connection whose close has not been delivered yet (its transport closing, `connection_lost` still to
    come) is replaced before a command is written, so the command is answered, not failed."""
    async def main() -> None:
        client = connect(redis_url)
        lane = lane_for(client)
        await lane.execute("SET", "k", "v")
        lane._conn.transport.close()  # as when the loop has seen the close but not yet called back
        assert await lane.execute("GET", "k") == b"v"
        lane._conn.transport.close()
        assert await lane.execute_many([("GET", "k"), ("EXISTS", "k")]) == [b"v", 1]
        await lane.aclose()
        await client.aclose()

    asyncio.run(main())


def test_a_hung_redis_times_out_and_a_restarted_one_is_used_again(restartable_redis: RedisServer) -> None:
    async def main() -> None:
        client = connect(restartable_redis.url)
        lane = RedisLane(client, timeout_s=0.5)
        await lane.execute("SET", "k", "v")
        restartable_redis.pause()
        started = time.monotonic()
        try:
            waiting = [asyncio.ensure_future(lane.execute("GET", "k")) for _ in range(3)]
            for w in waiting:
                with pytest.raises(RedisTimeoutError):
                    await w
            assert 0.45 < time.monotonic() - started < 0.5 + 1.0
        finally:
            restartable_redis.resume()
        assert await lane.execute("GET", "k") == b"v"  # a new connection
        restartable_redis.stop()
        with pytest.raises(RedisConnectionError):
            await lane.execute("GET", "k")
        restartable_redis.start()
        assert await lane.execute("GET", "k") == b"v"  # persisted across the restart, reconnected
        await lane.aclose()
        await client.aclose()

    asyncio.run(main())


def test_the_urls_password_and_database_apply_and_loops_may_change(restartable_redis: RedisServer) -> None:
    port = restartable_redis.port
    secret = f"pw-{random.randrange(10**9)}"

    async def setup() -> None:
        admin = aioredis.Redis.from_url(restartable_redis.url)
        await admin.config_set("requirepass", secret)
        await admin.aclose()

    asyncio.run(setup())
    client = connect(f"redis://:{secret}@127.0.0.1:{port}/3")
    lane = lane_for(client)

    async def write() -> None:
        assert await lane.execute("SET", "in-db-3", "yes") == b"OK"

    async def read() -> None:  # a second event loop: the lane connects again
        assert await lane.execute("GET", "in-db-3") == b"yes"
        db3 = aioredis.Redis.from_url(f"redis://:{secret}@127.0.0.1:{port}/3")
        db0 = aioredis.Redis.from_url(f"redis://:{secret}@127.0.0.1:{port}/0")
        assert await db3.get("in-db-3") == b"yes" and await db0.get("in-db-3") is None
        wrong = RedisLane(connect(f"redis://:not-{secret}@127.0.0.1:{port}/0"))
        with pytest.raises(RedisConnectionError, match="refused AUTH") as err:
            await wrong.execute("PING")
        assert secret not in str(err.value)
        await db0.config_set("requirepass", "")
        for c in (db3, db0):
            await c.aclose()
        await lane.aclose()

    asyncio.run(write())
    asyncio.run(read())


def test_tls_clients_have_no_lane() -> None:
    assert lane_for(connect("rediss://127.0.0.1:1/0")) is None
    assert lane_for(connect("unix:///tmp/edgeserve-none.sock")) is not None


def test_a_pipeline_leaves_in_one_write_and_keeps_its_order(redis_url: str) -> None:
    async def main() -> None:
        client = connect(redis_url)
        lane = lane_for(client)
        rng = random.Random()
        members = {f"s{i}": {rng.randbytes(8) for _ in range(rng.randint(1, 4))} for i in range(20)}
        for key, values in members.items():
            await client.sadd(key, *values)
        keys = [*members, "absent"]
        rng.shuffle(keys)
        commands = [("SMEMBERS", k) for k in keys] + [("EXISTS", k) for k in keys]
        got = await run_pipeline(client, commands)
        assert [set(r) for r in got[:len(keys)]] == [members.get(k, set()) for k in keys]
        assert got[len(keys):] == [int(k in members) for k in keys]
        with pytest.raises(ResponseError, match="WRONGTYPE"):
            await lane.execute_many([("SET", "str", "x"), ("SMEMBERS", "str"), ("SET", "after", "y")])
        assert await lane.execute("GET", "after") == b"y"  # the commands after the error ran, and in step
        assert await lane.execute_many([]) == []
        await lane.aclose()
        await client.aclose()

    asyncio.run(main())
