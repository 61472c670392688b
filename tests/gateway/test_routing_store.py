"""Routing with the KV store tier (real Redis): a block in the store is cheaper than a recompute and
dearer than a worker's own cached block, and the store-tier index entries (KV events with tier
"store") are counted per tenant-salted hash, expire, and survive a worker's withdrawal."""

from __future__ import annotations

import asyncio
from collections import deque

import pytest
import redis.asyncio as aioredis

from backend.prefix_cache_pool import KVEvent
from gateway.regions import RegionMap
from gateway.registry_view import RegistryView
from gateway.router import STORE_TOKEN_COST, Router, prefill_cost
from prefix_cache.hashing import block_hashes
from prefix_cache.kv_events import KVEventPublisher, PrefixIndex, TierOverlap, events_key, store_block_key
from tests.gateway.test_routing import PROMPT, rec, register

TENANT = "tenant-1"
HASHES = block_hashes(PROMPT, 16, TENANT)  # 5 full blocks


async def publish(redis_url: str, worker_id: str, *events: KVEvent, store_ttl_s: int = 600) -> KVEventPublisher:
    pub = KVEventPublisher(redis_url, "m", worker_id, deque(events), store_ttl_s=store_ttl_s)
    await pub.flush()
    return pub


def test_a_store_hit_costs_less_than_a_recompute_and_more_than_a_local_hit() -> None:
    p = len(PROMPT)
    recompute = prefill_cost(p, 0, 0)
    store_hit = prefill_cost(p, 0, 64)
    local_hit = prefill_cost(p, 64, 0)
    assert recompute == p and local_hit == p - 64
    assert local_hit < store_hit < recompute
    assert store_hit == pytest.approx(p - 64 + STORE_TOKEN_COST * 64)
    assert prefill_cost(p, 64, 80) == pytest.approx(1 + STORE_TOKEN_COST * 15)  # the store beyond the local overlap
    assert prefill_cost(p, 64, 32) == local_hit  # a store prefix shorter than the local one adds nothing
    assert prefill_cost(p, 0, 0, store_token_cost=1.0) == prefill_cost(p, 0, 80, store_token_cost=1.0)


def test_the_router_prefers_a_local_hit_and_spreads_sooner_with_a_store(redis_url: str) -> None:
    async def go() -> None:
        r = aioredis.Redis.from_url(redis_url)
        # every request of load weighs (no slack), so one running request tips the balance below
        rt = Router(RegistryView(r, refresh_s=0.0), PrefixIndex(r), RegionMap(), policy="prefix", load_tokens=40,
                    load_slack=0)
        # a holds 4 blocks itself; the store holds all 5
        a_pub = await publish(redis_url, "a", KVEvent("stored", HASHES[:4]), KVEvent("stored", HASHES, "store"))
        await register(redis_url, rec("a", "local", kv_store=True), rec("b", "local", kv_store=True))
        decision = await rt.route("m", TENANT, PROMPT, 8, "local", "r1")
        assert decision.candidates[0].worker.id == "a"  # equal load: the local hit beats the store hit
        assert "5 in the KV store" in decision.reason
        rt.done("r1")
        await register(redis_url, rec("a", "local", running=1, kv_store=True), rec("b", "local", kv_store=True))
        # computed (and fetched) tokens weigh 2: a 2 x (1 + 0.25 * 15) + 40 (load) = 49.5; b 2 x (1 + 0.25 * 79)
        # = 41.5: b fetches the prefix
        assert (await rt.route("m", TENANT, PROMPT, 8, "local", "r2")).candidates[0].worker.id == "b"
        rt.done("r2")
        await register(redis_url, rec("a", "local", running=1, kv_store=True), rec("b", "local"))
        # b has no store: it would recompute all 80 tokens (160 > 49.5): a keeps the request
        assert (await rt.route("m", TENANT, PROMPT, 8, "local", "r2b")).candidates[0].worker.id == "a"
        rt.done("r2b")
        await register(redis_url, rec("a", "local", running=1, kv_store=True), rec("b", "local", kv_store=True))
        await publish(redis_url, "a", KVEvent("removed", HASHES, "store"))  # the store lost them
        # without the store: a 2 x 16 + 40 = 72, b 160: a again
        assert (await rt.route("m", TENANT, PROMPT, 8, "local", "r3")).candidates[0].worker.id == "a"
        await a_pub.redis.aclose()
        await r.aclose()

    asyncio.run(go())


def test_store_entries_are_per_tenant_expire_and_outlive_a_workers_withdrawal(redis_url: str) -> None:
    async def go() -> None:
        r = aioredis.Redis.from_url(redis_url)
        index = PrefixIndex(r)
        pub = await publish(redis_url, "w1", KVEvent("stored", HASHES[:3], "store"), KVEvent("stored", HASHES[:2]),
                            store_ttl_s=1)
        assert await index.overlap_tiers("m", HASHES) == TierOverlap({"w1": 2}, 3)
        assert await index.overlap("m", HASHES) == {"w1": 2}  # the local tier alone, as before
        other = block_hashes(PROMPT, 16, "tenant-2")
        assert await index.overlap_tiers("m", other) == TierOverlap({}, 0)  # another tenant's salt: nothing
        entries = await r.xrange(events_key("m"))
        assert [e[1][b"tier"] for e in entries] == [b"store", b"local"]
        await pub.withdraw()  # a worker leaving takes its own blocks, not the store's
        assert await index.overlap_tiers("m", HASHES) == TierOverlap({}, 3)
        assert 0 < await r.ttl(store_block_key("m", HASHES[0])) <= 1
        await asyncio.sleep(1.2)
        assert await index.overlap_tiers("m", HASHES) == TierOverlap({}, 0)  # expired: the store evicts silently
        await pub.redis.aclose()
        await r.aclose()

    asyncio.run(go())
