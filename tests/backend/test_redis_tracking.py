"""`backend.redis_tracking` against a real redis-server: tracked reads are kept until another client
writes the key (never longer, also under concurrent writes), untracked ones are never kept, and
the cache empties when its connection closes, when Redis falls silent, on FLUSHALL, when full,
and is never used where Redis refuses tracking."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import redis.asyncio as aioredis

from backend.redis_client import connect
from backend.redis_tracking import MISS, TrackedReads
from ops.redis_server import RedisServer


def _get(key: str) -> tuple[str, ...]:
    return ("GET", key)


async def _settled(tracked: TrackedReads) -> None:
    """Every invalidation Redis sent before now has been read: a reply on the tracking connection comes after."""
    await tracked.read("settle", _get("settle"), track=False)
    conn = tracked._conn
    if conn is not None:
        await conn.send(b"*1\r\n$4\r\nPING\r\n")


def test_a_tracked_read_is_kept_until_another_client_writes_the_key(redis_url: str) -> None:
    async def main() -> None:
        writer, client = connect(redis_url), connect(redis_url)
        tracked = TrackedReads(client)
        value = str(random.random())
        await writer.set("k", value)
        assert await tracked.read("k", _get("k"), track=False) == value.encode()
        assert tracked.get("k", _get("k")) is MISS  # an untracked read is never kept
        assert await tracked.read("k", _get("k"), parse=bytes.decode) == value
        assert tracked.get("k", _get("k")) == value  # parsed once, kept
        assert tracked.get("k", ("STRLEN", "k")) is MISS  # another read of the same key is its own entry
        await writer.set("other", "x")  # a write elsewhere leaves it
        await _settled(tracked)
        assert tracked.get("k", _get("k")) == value
        await writer.set("k", value + "!")
        deadline = time.monotonic() + 2
        while tracked.get("k", _get("k")) is not MISS:
            assert time.monotonic() < deadline, "the invalidation never arrived"
            await asyncio.sleep(0.001)
        assert await tracked.read("k", _get("k"), parse=bytes.decode) == value + "!"
        assert await tracked.read("absent", _get("absent")) is None
        assert tracked.get("absent", _get("absent")) is None  # a missing key is an answer too
        await writer.set("absent", "now")  # and creating it invalidates that answer
        await _settled(tracked)
        assert tracked.get("absent", _get("absent")) is MISS
        await tracked.aclose()
        await writer.aclose()
        await client.aclose()

    asyncio.run(main())


def test_under_concurrent_writes_every_kept_reply_is_the_current_value(redis_url: str) -> None:
    """Readers and writers race on a few hashes; whatever the cache holds once the writes stop must equal
    Redis. A reply stored after an invalidation it came before, or a missed push, leaves an old value."""
    async def main() -> None:
        writer, client, check = connect(redis_url), connect(redis_url), connect(redis_url)
        tracked = TrackedReads(client)
        rng = random.Random()
        keys = [f"h{i}" for i in range(4)]
        stop = asyncio.Event()
        hits = 0

        async def write() -> None:
            while not stop.is_set():
                await writer.hset(rng.choice(keys), "f", rng.randrange(10**9))
                await asyncio.sleep(0)

        async def read() -> None:
            nonlocal hits
            while not stop.is_set():
                key = rng.choice(keys)
                command = ("HGET", key, "f")
                if tracked.get(key, command) is MISS:
                    await tracked.read(key, command)
                else:
                    hits += 1
                    await asyncio.sleep(0)

        tasks = [asyncio.ensure_future(write()) for _ in range(2)] + [asyncio.ensure_future(read()) for _ in range(3)]
        await asyncio.sleep(1.0)
        stop.set()
        await asyncio.gather(*tasks)
        await _settled(tracked)
        assert hits > 0  # the race went through the cache, not around it
        held = {k: tracked.get(k, ("HGET", k, "f")) for k in keys}
        for key, value in held.items():
            if value is not MISS:
                assert value == await check.hget(key, "f"), key
        for key in keys:  # and a read of each now is kept and current
            assert await tracked.read(key, ("HGET", key, "f")) == await check.hget(key, "f")
            assert tracked.get(key, ("HGET", key, "f")) == await check.hget(key, "f")
        await tracked.aclose()
        for c in (writer, client, check):
            await c.aclose()

    asyncio.run(main())


def test_the_cache_empties_when_its_connection_closes_or_redis_is_flushed(redis_url: str) -> None:
    async def main() -> None:
        admin, client = connect(redis_url), connect(redis_url)
        tracked = TrackedReads(client, ping_interval_s=60, stale_after_s=120)  # only the close can drop it
        await admin.set("a", "1")
        assert await tracked.read("a", _get("a")) == b"1"
        killed = await admin.client_kill_filter(_id=await _tracking_client_id(admin))
        assert killed == 1
        deadline = time.monotonic() + 2
        while tracked.get("a", _get("a")) is not MISS:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.001)
        assert await tracked.read("a", _get("a")) == b"1"  # a new connection, tracked again
        assert tracked.get("a", _get("a")) == b"1"
        await admin.flushall()
        await _settled(tracked)
        assert tracked.get("a", _get("a")) is MISS
        await tracked.aclose()
        await admin.aclose()
        await client.aclose()

    asyncio.run(main())


async def _tracking_client_id(admin: aioredis.Redis) -> int:
    clients = [c for c in await admin.client_list() if c.get("flags", "").find("t") >= 0]
    assert len(clients) == 1, clients
    return int(clients[0]["id"])


def test_a_silent_redis_stops_the_cache(restartable_redis: RedisServer) -> None:
    """Paused (as a partition that leaves the socket open: no close, no invalidations), Redis is not
    heard from, so nothing is served from the cache after `stale_after_s`."""
    async def main() -> None:
        client = connect(restartable_redis.url)
        tracked = TrackedReads(client, ping_interval_s=0.05, stale_after_s=0.2)
        await client.set("s", "v")
        assert await tracked.read("s", _get("s")) == b"v"
        await asyncio.sleep(0.4)  # pings answered: still fresh
        assert tracked.get("s", _get("s")) == b"v"
        restartable_redis.pause()
        try:
            await asyncio.sleep(0.3)
            assert tracked.get("s", _get("s")) is MISS
        finally:
            restartable_redis.resume()
        assert await tracked.read("s", _get("s")) == b"v"
        await tracked.aclose()
        await client.aclose()

    asyncio.run(main())


def test_it_holds_at_most_max_keys(redis_url: str) -> None:
    async def main() -> None:
        client = connect(redis_url)
        tracked = TrackedReads(client, max_keys=3)
        for i in range(7):
            await tracked.read(f"m{i}", _get(f"m{i}"))
            assert 1 <= len(tracked._entries) <= 3
        assert tracked.get("m6", _get("m6")) is None  # the newest is kept
        await tracked.aclose()
        await client.aclose()

    asyncio.run(main())


def test_where_redis_refuses_tracking_reads_are_plain(redis_url: str) -> None:
    async def main() -> None:
        admin = connect(redis_url)
        password = f"pw{random.randrange(10**9)}"
        await admin.execute_command("ACL", "SETUSER", "notrack", "on", f">{password}", "~*", "+@all", "-client")
        host, port = redis_url.removeprefix("redis://").split("/")[0].split(":")
        client = connect(f"redis://notrack:{password}@{host}:{port}/0")
        tracked = TrackedReads(client)
        await admin.set("p", "1")
        assert await tracked.read("p", _get("p")) == b"1"
        assert not tracked.enabled and tracked.get("p", _get("p")) is MISS
        await admin.set("p", "2")
        assert await tracked.read("p", _get("p")) == b"2"
        await tracked.aclose()
        await admin.execute_command("ACL", "DELUSER", "notrack")
        await admin.aclose()
        await client.aclose()

    asyncio.run(main())


def test_tls_clients_read_plainly() -> None:
    tracked = TrackedReads(connect("rediss://127.0.0.1:1/0"))
    assert not tracked.enabled


@pytest.mark.parametrize("kind", ["revoke", "quota"])
def test_a_tenant_stores_cache_follows_writes_by_other_processes(redis_url: str, kind: str) -> None:
    """A gateway's store answers held tokens without Redis (no HGET or HMGET sent), yet a key revoked or a
    quota changed through another client applies to the very next request, every time."""
    from backend.errors import AuthenticationError
    from gateway.tenants import TenantStore

    async def reads(admin: aioredis.Redis) -> int:
        stats = await admin.info("commandstats")
        return sum(stats.get(f"cmdstat_{c}", {}).get("calls", 0) for c in ("hget", "hmget"))

    async def main() -> None:
        admin, gateway = connect(redis_url), connect(redis_url)
        other, store = TenantStore(admin), TenantStore(gateway, tracked=True)
        tenant = await other.create_tenant("acme", requests_per_minute=5)
        stranger = "Bearer es_" + "x" * 43
        for _ in range(3):
            with pytest.raises(AuthenticationError):
                await store.authenticate(stranger)
        assert not store._tracked._entries  # a token that never authenticated is not tracked
        for round_ in range(50):
            key = await other.create_key(tenant.id)
            for _ in range(2):  # the first lookup is plain, the second tracked
                assert (await store.authenticate(f"Bearer {key.token}")).id == tenant.id
            before = await reads(admin)
            for _ in range(5):
                pending = store.begin(f"Bearer {key.token}")
                assert pending._lookup.done() and (await pending.confirm()).id == tenant.id
            assert await reads(admin) == before  # held: nothing read from Redis
            if kind == "revoke":
                await other.revoke_key(key.key_id)
                with pytest.raises(AuthenticationError):
                    await store.authenticate(f"Bearer {key.token}")
            else:
                await other.set_quotas(tenant.id, requests_per_minute=round_ + 10, tokens_per_day=None)
                assert (await store.authenticate(f"Bearer {key.token}")).requests_per_minute == round_ + 10
        await store.aclose()
        await admin.aclose()
        await gateway.aclose()

    asyncio.run(main())
