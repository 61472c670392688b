"""Per-tenant quotas against a real Redis, including concurrent admission from two "replicas"."""

from __future__ import annotations

import asyncio
import time
import types

import pytest
import redis
import redis.asyncio

from backend.errors import QuotaExceeded
from gateway import quotas as quotas_module
from gateway import redis_keys as rk
from gateway.quotas import Quotas, Reservation
from gateway.tenants import Tenant


async def _server_time(client: redis.asyncio.Redis) -> tuple[int, int]:
    """(unix seconds, ms) by the Redis clock."""
    s, us = await client.time()
    return s, s * 1000 + us // 1000


def _run(redis_url: str, body, clients: int = 1):
    async def main():
        opened = [redis.asyncio.Redis.from_url(redis_url) for _ in range(clients)]
        try:
            return await body(*opened)
        finally:
            for client in opened:
                await client.aclose()
    return asyncio.run(main())


def test_requests_per_minute_refuses_the_fourth_and_consumes_nothing(redis_url: str) -> None:
    tenant = Tenant("acme", "acme", requests_per_minute=3, tokens_per_day=10_000)

    async def body(client):
        quotas = Quotas(client)
        for i in range(3):
            r = await quotas.admit(tenant, f"req-{i}", prompt_tokens=10, max_tokens=20)
            # what is left comes back with the admission (rate-limit headers): 3 - (i + 1) requests, and
            # 10_000 - 30 (i + 1) tokens
            assert r == Reservation("acme", f"req-{i}", r.day, 30, 20, 2 - i, 10_000 - 30 * (i + 1))
        used = int(await client.get(rk.tokens_day("acme", r.day)))
        for attempt in range(2):
            with pytest.raises(QuotaExceeded) as info:
                await quotas.admit(tenant, f"refused-{attempt}", prompt_tokens=10, max_tokens=20)
            details = info.value.details
            assert details["quota"] == "requests_per_minute" and details["limit"] == 3
            assert 1 <= details["retry_after_s"] <= 60
            assert info.value.code == 3036 and info.value.http_status == 429
        assert await client.zcard(rk.rpm_window("acme")) == 3
        assert int(await client.get(rk.tokens_day("acme", r.day))) == used == 90
        assert 0 < await client.pttl(rk.rpm_window("acme")) <= 61_000
    _run(redis_url, body)


def test_window_slides_by_the_redis_clock(redis_url: str) -> None:
    tenant = Tenant("acme", "acme", requests_per_minute=2)

    async def body(client):
        _, now_ms = await _server_time(client)
        # one admission 61 s ago (outside the window), one 50 s ago (leaves in ~10 s)
        await client.zadd(rk.rpm_window("acme"), {"old": now_ms - 61_000, "recent": now_ms - 50_000})
        quotas = Quotas(client)
        await quotas.admit(tenant, "a", 1, 1)
        with pytest.raises(QuotaExceeded) as info:
            await quotas.admit(tenant, "b", 1, 1)
        assert info.value.details["retry_after_s"] == 10
        members = {m.decode().split(":")[0] for m in await client.zrange(rk.rpm_window("acme"), 0, -1)}
        assert members == {"recent", "a"}
    _run(redis_url, body)


def test_tokens_per_day_caps_the_grant_then_refuses(redis_url: str) -> None:
    tenant = Tenant("acme", "acme", tokens_per_day=100)

    async def body(client):
        quotas = Quotas(client)
        now_s, _ = await _server_time(client)
        first = await quotas.admit(tenant, "r1", prompt_tokens=30, max_tokens=50)
        assert first == Reservation("acme", "r1", rk.utc_day(now_s), 80, 50, None, 20)  # no rpm limit: None
        second = await quotas.admit(tenant, "r2", prompt_tokens=10, max_tokens=50)
        assert (second.reserved_tokens, second.max_tokens) == (20, 10)  # capped: 100 - 80 - 10
        assert second.tokens_left == 0
        key = rk.tokens_day("acme", first.day)
        assert int(await client.get(key)) == 100
        assert 2 * 86_400 - 5 < await client.ttl(key) <= 2 * 86_400
        with pytest.raises(QuotaExceeded) as info:
            await quotas.admit(tenant, "r3", prompt_tokens=0, max_tokens=5)
        d = info.value.details
        assert d["quota"] == "tokens_per_day" and d["limit"] == 100
        assert 1 <= d["retry_after_s"] <= 86_400
        assert abs(d["retry_after_s"] - (86_400 - now_s % 86_400)) <= 2  # until the next UTC midnight
        assert int(await client.get(key)) == 100

        fresh = Tenant("fresh", "fresh", tokens_per_day=100)
        with pytest.raises(QuotaExceeded):  # needs prompt + 1 tokens left
            await quotas.admit(fresh, "long", prompt_tokens=100, max_tokens=1)
        edge = await quotas.admit(fresh, "edge", prompt_tokens=99, max_tokens=1000)
        assert (edge.reserved_tokens, edge.max_tokens) == (100, 1)
    _run(redis_url, body)


def test_unlimited_tenant_grants_the_request_and_writes_nothing(redis_url: str) -> None:
    async def body(client):
        r = await Quotas(client).admit(Tenant("free", "free"), "r1", prompt_tokens=500, max_tokens=4096)
        assert (r.reserved_tokens, r.max_tokens) == (0, 4096)
        assert r.day == rk.utc_day((await _server_time(client))[0])
        assert await client.dbsize() == 0
    _run(redis_url, body)


def test_a_client_clock_days_off_still_uses_the_redis_day(redis_url: str, monkeypatch) -> None:
    skewed = types.SimpleNamespace(time=lambda: time.time() + 5 * 86_400)
    monkeypatch.setattr(quotas_module, "time", skewed)
    tenant = Tenant("acme", "acme", tokens_per_day=1000)

    async def body(client):
        r = await Quotas(client).admit(tenant, "r1", prompt_tokens=5, max_tokens=5)
        server_day = rk.utc_day((await _server_time(client))[0])
        assert r.day == server_day
        assert [k.decode() for k in await client.keys("*")] == [rk.tokens_day("acme", server_day)]
    _run(redis_url, body)


def test_two_replicas_admit_exactly_the_rpm_limit(redis_url: str) -> None:
    tenant = Tenant("acme", "acme", requests_per_minute=20)

    async def body(a, b):
        replicas = [Quotas(a), Quotas(b)]
        results = await asyncio.gather(
            *(replicas[i % 2].admit(tenant, f"req-{i}", 10, 10) for i in range(50)), return_exceptions=True)
        admitted = [r for r in results if isinstance(r, Reservation)]
        refused = [r for r in results if isinstance(r, QuotaExceeded)]
        assert (len(admitted), len(refused)) == (20, 30)
        assert await a.zcard(rk.rpm_window("acme")) == 20
    _run(redis_url, body, clients=2)


def test_concurrent_reservations_never_exceed_the_daily_limit(redis_url: str) -> None:
    tenant = Tenant("acme", "acme", tokens_per_day=1000)

    async def body(a, b):
        replicas = [Quotas(a), Quotas(b)]
        results = await asyncio.gather(
            *(replicas[i % 2].admit(tenant, f"req-{i}", 10, 50) for i in range(40)), return_exceptions=True)
        admitted = [r for r in results if isinstance(r, Reservation)]
        assert all(isinstance(r, (Reservation, QuotaExceeded)) for r in results)
        # 16 full grants (960 tokens), one capped to the last 40, then refusals
        assert len(admitted) == 17
        assert sorted(r.max_tokens for r in admitted)[0] == 30
        total = sum(r.reserved_tokens for r in admitted)
        assert total == int(await a.get(rk.tokens_day("acme", admitted[0].day))) == 1000
    _run(redis_url, body, clients=2)
