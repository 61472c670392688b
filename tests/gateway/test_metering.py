"""Usage metering against a real Redis: exactly once per request id, reservation settlement, reads."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest
import redis.asyncio

from backend.errors import InvalidRequest
from gateway import redis_keys as rk
from gateway.metering import MARKER_TTL_S, USAGE_RETENTION_DAYS, Meter, UsageRecord
from gateway.quotas import Quotas
from gateway.tenants import Tenant

T0 = datetime(2026, 3, 1, 12, tzinfo=UTC).timestamp()
DAY = 86_400


def _usage(request_id: str = "req-1", model: str = "smollm2-135m", ended_at: float = T0, **kw) -> UsageRecord:
    fields = dict(prompt_tokens=100, cached_prompt_tokens=32, completion_tokens=50, finish_reason="stop")
    return UsageRecord(request_id, "acme", model, **{**fields, **kw}, started_at=ended_at - 1.5, ended_at=ended_at)


def _run(redis_url: str, body, clients: int = 1):
    async def main():
        opened = [redis.asyncio.Redis.from_url(redis_url) for _ in range(clients)]
        try:
            return await body(*opened)
        finally:
            for client in opened:
                await client.aclose()
    return asyncio.run(main())


def test_the_same_request_is_metered_once(redis_url: str) -> None:
    async def body(client):
        meter = Meter(client)
        usage = _usage()
        assert await meter.record(usage) is True
        assert await meter.record(usage) is False
        assert await meter.record(_usage(completion_tokens=999)) is False  # a different report of the same id
        day = rk.utc_day(T0)
        assert await meter.usage("acme", day, day) == {day: {"smollm2-135m": {
            "requests": 1, "prompt_tokens": 100, "cached_prompt_tokens": 32, "completion_tokens": 50}}}
        assert await client.xlen(rk.usage_events("acme")) == 1
        assert MARKER_TTL_S - 5 < await client.ttl(rk.metered("acme", "req-1")) <= MARKER_TTL_S
    _run(redis_url, body)


def test_settling_returns_the_unused_reservation(redis_url: str) -> None:
    tenant = Tenant("acme", "acme", tokens_per_day=1000)

    async def body(client):
        quotas, meter = Quotas(client), Meter(client)
        first = await quotas.admit(tenant, "r1", prompt_tokens=100, max_tokens=400)
        second = await quotas.admit(tenant, "r2", prompt_tokens=20, max_tokens=400)
        assert (first.reserved_tokens, second.reserved_tokens) == (500, 420)
        key = rk.tokens_day("acme", first.day)
        assert await meter.record(_usage("r1", prompt_tokens=100, completion_tokens=50), first)
        assert int(await client.get(key)) == 150 + 420
        assert await meter.record(_usage("r2", prompt_tokens=20, completion_tokens=0, finish_reason="error",
                                         error_code=5040), second)
        assert not await meter.record(_usage("r2", prompt_tokens=20, completion_tokens=0), second)
        assert int(await client.get(key)) == 150 + 20  # exactly what was used
        # the usage lands on the reservation's day, not the record's ended_at
        assert list(await meter.usage("acme", first.day, first.day)) == [first.day]
        # freed tokens can be granted again
        third = await quotas.admit(tenant, "r3", prompt_tokens=30, max_tokens=10_000)
        assert third.max_tokens == 1000 - 170 - 30
    _run(redis_url, body)


def test_release_returns_the_whole_reservation_once(redis_url: str) -> None:
    tenant = Tenant("acme", "acme", tokens_per_day=1000)

    async def body(client):
        quotas, meter = Quotas(client), Meter(client)
        kept = await quotas.admit(tenant, "kept", prompt_tokens=10, max_tokens=90)
        dropped = await quotas.admit(tenant, "dropped", prompt_tokens=100, max_tokens=400)
        key = rk.tokens_day("acme", dropped.day)
        assert int(await client.get(key)) == 600
        assert await meter.release(dropped) is True
        assert await meter.release(dropped) is False
        assert await meter.record(_usage("dropped"), dropped) is False  # settled already
        assert int(await client.get(key)) == kept.reserved_tokens == 100
        assert await client.xlen(rk.usage_events("acme")) == 0
        assert await meter.release(await quotas.admit(Tenant("free", "free"), "r", 1, 1)) is True
        assert not await client.exists(rk.tokens_day("free", dropped.day))
    _run(redis_url, body)


def test_unreserved_settlement_touches_no_counter(redis_url: str) -> None:
    async def body(client):
        reservation = await Quotas(client).admit(Tenant("acme", "acme"), "r1", 100, 50)
        assert await Meter(client).record(_usage("r1"), reservation)
        assert not await client.exists(rk.tokens_day("acme", reservation.day))
        with pytest.raises(InvalidRequest):
            await Meter(client).record(_usage("other"), reservation)
    _run(redis_url, body)


def test_usage_per_day_and_model(redis_url: str) -> None:
    async def body(client):
        meter = Meter(client)
        await meter.record(_usage("a", "m1"))
        await meter.record(_usage("b", "m1", prompt_tokens=10, cached_prompt_tokens=0, completion_tokens=5))
        await meter.record(_usage("c", "org/m2|v1"))
        await meter.record(_usage("d", "m1", ended_at=T0 + 2 * DAY))
        await meter.record(_usage("e", "m1", ended_at=T0 + 40 * DAY))
        d0, d2 = rk.utc_day(T0), rk.utc_day(T0 + 2 * DAY)
        assert await meter.usage("acme", d0, rk.utc_day(T0 + 3 * DAY)) == {
            d0: {"m1": {"requests": 2, "prompt_tokens": 110, "cached_prompt_tokens": 32, "completion_tokens": 55},
                 "org/m2|v1": {"requests": 1, "prompt_tokens": 100, "cached_prompt_tokens": 32,
                               "completion_tokens": 50}},
            d2: {"m1": {"requests": 1, "prompt_tokens": 100, "cached_prompt_tokens": 32, "completion_tokens": 50}},
        }
        assert await meter.usage("other-tenant", d0, d2) == {}
        assert len(await meter.usage("acme", d0, rk.utc_day(T0 + 92 * DAY))) == 3  # 93 days: allowed
        for start, end in [(rk.utc_day(T0 + DAY), d0), (d0, rk.utc_day(T0 + 93 * DAY)), ("2026-3-1", d0)]:
            with pytest.raises(InvalidRequest):
                await meter.usage("acme", start, end)
    _run(redis_url, body)


def test_events_round_trip_newest_last(redis_url: str) -> None:
    async def body(client):
        meter = Meter(client)
        records = [_usage(f"r{i}", ended_at=T0 + i + 0.123456) for i in range(5)]
        records.append(_usage("failed", finish_reason="error", error_code=5040, completion_tokens=0))
        for record in records:
            assert await meter.record(record)
        assert await meter.events("acme") == records
        assert await meter.events("acme", count=2) == records[-2:]
        assert await meter.events("nobody") == []
    _run(redis_url, body)


def test_concurrent_duplicate_reports_count_once(redis_url: str) -> None:
    tenant = Tenant("acme", "acme", tokens_per_day=1000)

    async def body(a, b):
        reservation = await Quotas(a).admit(tenant, "req-1", prompt_tokens=100, max_tokens=400)
        meters = [Meter(a), Meter(b)]
        results = await asyncio.gather(*(meters[i % 2].record(_usage(), reservation) for i in range(20)))
        assert sorted(results) == [False] * 19 + [True]
        assert (await meters[0].usage("acme", reservation.day, reservation.day))[reservation.day][
            "smollm2-135m"]["requests"] == 1
        assert await a.xlen(rk.usage_events("acme")) == 1
        assert int(await a.get(rk.tokens_day("acme", reservation.day))) == 150
    _run(redis_url, body, clients=2)


def test_daily_usage_expires_after_the_documented_retention(redis_url: str) -> None:
    import time

    async def body(client):
        now = time.time()
        assert await Meter(client).record(_usage("fresh", ended_at=now))
        day = rk.utc_day(now)
        day_end = datetime.fromisoformat(day).replace(tzinfo=UTC).timestamp() + DAY
        ttl = await client.ttl(rk.usage("acme", day))
        assert abs(ttl - (day_end + USAGE_RETENTION_DAYS * DAY - now)) < 5
        # a record from a day already past retention leaves no counters behind (replays of ancient entries)
        old = now - (USAGE_RETENTION_DAYS + 2) * DAY
        assert await Meter(client).record(_usage("ancient", ended_at=old))
        assert not await client.exists(rk.usage("acme", rk.utc_day(old)))
    _run(redis_url, body)


def test_records_queued_together_are_written_per_tenant_and_a_close_writes_them_without_waiting(
        redis_url: str) -> None:
    tenant = Tenant("acme", "acme", tokens_per_day=1000)

    async def body(client):
        quotas = Quotas(client)
        first = await quotas.admit(tenant, "a1", prompt_tokens=100, max_tokens=400)
        third = await quotas.admit(tenant, "a3", prompt_tokens=10, max_tokens=40)
        meter = Meter(client, flush_after_s=60.0)  # only the close writes them
        records = [(_usage("a1"), first), (_usage("a2", completion_tokens=7), None),
                   (UsageRecord("b1", "bravo", "m1", 5, 0, 6, "length", started_at=T0 - 1, ended_at=T0), None),
                   (_usage("a2", completion_tokens=7), None),  # a duplicate in the same batch
                   (_usage("a3", "m2", prompt_tokens=10, cached_prompt_tokens=0, completion_tokens=4), third),
                   (_usage("a4", completion_tokens=1), None)]
        tasks = [asyncio.create_task(meter.record(usage, res)) for usage, res in records]
        await asyncio.sleep(0.05)
        assert not any(t.done() for t in tasks)
        assert await client.xlen(rk.usage_events("acme")) == 0  # queued, not yet written
        started = asyncio.get_running_loop().time()
        await meter.aclose()
        assert asyncio.get_running_loop().time() - started < 5
        assert [t.result() for t in tasks] == [True, True, True, False, True, True]
        day, today = rk.utc_day(T0), first.day  # a1 and a3 land on their reservation's day
        assert (await meter.usage("acme", day, day))[day] == {"smollm2-135m": {
            "requests": 2, "prompt_tokens": 200, "cached_prompt_tokens": 64, "completion_tokens": 8}}
        assert (await meter.usage("acme", today, today))[today] == {
            "smollm2-135m": {"requests": 1, "prompt_tokens": 100, "cached_prompt_tokens": 32, "completion_tokens": 50},
            "m2": {"requests": 1, "prompt_tokens": 10, "cached_prompt_tokens": 0, "completion_tokens": 4}}
        assert await meter.usage("bravo", day, day) == {day: {"m1": {
            "requests": 1, "prompt_tokens": 5, "cached_prompt_tokens": 0, "completion_tokens": 6}}}
        assert await meter.events("bravo") == [records[2][0]]
        assert await meter.events("acme") == [records[i][0] for i in (0, 1, 4, 5)]
        assert int(await client.get(rk.tokens_day("acme", first.day))) == 150 + 14  # both refunds applied
        assert await client.hget(rk.usage("acme", today), "m2|cached_prompt_tokens") == b"0"  # zeros are kept
    _run(redis_url, body)
