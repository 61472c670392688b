"""The prefix index stays bounded and true through Redis outages and worker deaths (real Redis).

Failed KV-event batches are re-sent in order; events lost (too many waiting, or
dropped by the engine's bounded queue) make the index stale, and it is rebuilt;
a worker that died without withdrawing is removed once its record has expired."""

from __future__ import annotations

import asyncio
import time
from collections import deque

import redis.asyncio as aioredis

from backend.prefix_cache_pool import KVEvent
from backend.registration import Heartbeat, WorkerRecord, members_key, record_key
from gateway.registry_view import RegistryView
from ops.redis_server import RedisServer
from prefix_cache.kv_events import KVEventPublisher, PrefixIndex, block_key, forget_worker, worker_blocks_key

H = [bytes([i]) * 8 for i in range(6)]  # block hashes


async def _held(r: aioredis.Redis, worker: str) -> set[bytes]:
    return {bytes.fromhex(m.decode()) for m in await r.smembers(worker_blocks_key("m", worker))}


def test_a_batch_redis_missed_is_resent_in_order(restartable_redis: RedisServer) -> None:
    async def main() -> None:
        events: deque[KVEvent] = deque()
        pub = KVEventPublisher(restartable_redis.url, "m", "w1", events)
        r = aioredis.Redis.from_url(restartable_redis.url)
        restartable_redis.stop()
        events.extend([KVEvent("stored", [H[0], H[1]]), KVEvent("stored", [H[2]])])
        assert await pub.flush() == 0  # kept, not dropped
        events.append(KVEvent("removed", [H[1]]))
        restartable_redis.start()
        assert await pub.flush() == 3
        assert await _held(r, "w1") == {H[0], H[2]}
        assert await PrefixIndex(r).overlap("m", [H[0], H[2]]) == {"w1": 2}
        assert not pub.stale
        await pub.redis.aclose()
        await r.aclose()

    asyncio.run(main())


def test_lost_events_make_the_index_stale_and_it_is_rebuilt(restartable_redis: RedisServer) -> None:
    async def main() -> None:
        events: deque[KVEvent] = deque()
        dropped, resyncs = [0], []
        pub = KVEventPublisher(restartable_redis.url, "m", "w1", events, dropped=lambda: dropped[0],
                               resync=lambda: resyncs.append(1) or events.append(KVEvent("stored", [H[4], H[5]])),
                               max_unsent=2)
        r = aioredis.Redis.from_url(restartable_redis.url)
        events.append(KVEvent("stored", [H[0], H[1]]))
        assert await pub.flush() == 1
        restartable_redis.stop()
        events.extend([KVEvent("removed", [H[0]]), KVEvent("stored", [H[2]]), KVEvent("stored", [H[3]])])
        assert await pub.flush() == 0 and pub.stale  # three waiting > max_unsent: dropped, index stale
        restartable_redis.start()
        assert await pub.flush() == 0 and resyncs == [1]  # withdrawn; the engine re-reports its cache
        assert await _held(r, "w1") == set()  # nothing it may no longer hold (H[0] was removed)
        assert await pub.flush() == 1 and await _held(r, "w1") == {H[4], H[5]}
        assert not await r.exists(block_key("m", H[0]))

        dropped[0] = 3  # the engine's bounded queue overflowed: what it dropped is unknown
        assert await pub.flush() == 0 and resyncs == [1, 1]
        assert await pub.flush() == 1 and await _held(r, "w1") == {H[4], H[5]}
        await pub.redis.aclose()
        await r.aclose()

    asyncio.run(main())


def _record(wid: str) -> WorkerRecord:
    return WorkerRecord(id=wid, url=f"http://{wid}.invalid", role="unified", model="m", region="eu", page_size=16,
                        pages_total=100, pages_free=100, running=0, waiting=0, queued_prefill_tokens=0)


def test_a_dead_workers_registry_and_index_entries_are_removed(redis_url: str) -> None:
    async def main() -> None:
        r = aioredis.Redis.from_url(redis_url)
        for wid, ttl_s, blocks in (("dead", 0.2, [H[0], H[1]]), ("live", 30.0, [H[0], H[2]])):
            hb = Heartbeat(redis_url, lambda wid=wid: _record(wid), ttl_s=ttl_s)
            await hb.beat()
            await hb.redis.aclose()
            pub = KVEventPublisher(redis_url, "m", wid, deque([KVEvent("stored", blocks)]))
            await pub.flush()  # a SIGKILLed worker never withdraws this
            await pub.redis.aclose()
        assert await forget_worker(r, "m", "live") == -1  # alive: untouched
        time.sleep(0.3)
        assert [w.id for w in await RegistryView(r, refresh_s=0.0).workers("m")] == ["live"]
        assert {m.decode() for m in await r.smembers(members_key("m"))} == {"live"}
        assert not await r.exists(worker_blocks_key("m", "dead"), block_key("m", H[1]))
        assert {m.decode() for m in await r.smembers(block_key("m", H[0]))} == {"live"}
        assert await _held(r, "live") == {H[0], H[2]}
        assert not await r.exists(record_key("m", "dead"))
        await r.aclose()

    asyncio.run(main())
