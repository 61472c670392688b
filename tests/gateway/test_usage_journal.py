"""Usage stays exactly once across a Redis outage and a gateway restart: the local journal and its replay.

A real redis-server of the test's own is stopped (or hung with SIGSTOP) and started
again on the same port with its data; the journal is a real file."""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import msgspec
import pytest
import redis.asyncio

from backend.errors import EdgeServeError
from backend.redis_client import connect
from gateway import redis_keys as rk
from gateway.metering import Meter, UsageRecord
from gateway.quotas import Quotas
from gateway.tenants import Tenant
from gateway.usage_journal import UsageJournal
from ops.redis_server import RedisServer


def _usage(request_id: str, completion_tokens: int = 150) -> UsageRecord:
    now = time.time()
    return UsageRecord(request_id, "acme", "m", prompt_tokens=20, cached_prompt_tokens=0,
                       completion_tokens=completion_tokens, finish_reason="stop", started_at=now - 1, ended_at=now)


async def _totals(client: redis.asyncio.Redis) -> dict[str, int]:
    """The tenant's usage today, for model "m" (every metric), and its event count."""
    meter = Meter(client)
    day = rk.utc_day()
    per_model = (await meter.usage("acme", day, day)).get(day, {}).get("m", {})
    return {**per_model, "events": await client.xlen(rk.usage_events("acme"))}


def test_a_record_made_while_redis_is_down_is_metered_once_when_it_returns(
        restartable_redis: RedisServer, tmp_path: Path) -> None:
    journal = tmp_path / "journal" / "gw.jsonl"

    async def main() -> None:
        client = connect(restartable_redis.url)
        meter = Meter(client, journal, replay_interval_s=60)  # this test replays by hand
        restartable_redis.stop()
        assert await meter.record(_usage("r1")) is True  # journaled, not lost (the old code raised here)
        assert meter.pending == 1 and journal.stat().st_size > 0
        assert await meter.replay() == 0  # still down: kept
        restartable_redis.start()
        assert await meter.replay() == 1
        assert await _totals(client) == {"requests": 1, "prompt_tokens": 20, "cached_prompt_tokens": 0,
                                         "completion_tokens": 150, "events": 1}
        assert meter.pending == 0 and journal.stat().st_size == 0  # compacted
        assert await meter.replay() == 0
        assert await meter.record(_usage("r1")) is False  # the marker remembers it
        assert (await _totals(client))["requests"] == 1
        await meter.aclose()
        await client.aclose()

    asyncio.run(main())


def test_a_restarted_gateway_replays_its_journal_and_a_second_replay_counts_nothing(
        restartable_redis: RedisServer, tmp_path: Path) -> None:
    journal = tmp_path / "gw.jsonl"

    async def main() -> None:
        client = connect(restartable_redis.url)
        first = Meter(client, journal, replay_interval_s=60)
        restartable_redis.stop()
        await first.record(_usage("r1"))
        await first.record(_usage("r2", completion_tokens=7))
        await first.aclose()  # the gateway goes away with Redis still down
        copy = tmp_path / "before-replay.jsonl"
        shutil.copy(journal, copy)
        restartable_redis.start()

        second = Meter(client, journal, replay_interval_s=0.05)
        await second.start()  # replays at start, in the background
        deadline = time.monotonic() + 5
        while second.pending:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        totals = await _totals(client)
        assert (totals["requests"], totals["completion_tokens"], totals["events"]) == (2, 157, 2)
        await second.aclose()

        shutil.copy(copy, journal)  # as if the settled marks had been lost: everything replays again
        third = Meter(client, journal, replay_interval_s=60)
        assert third.pending == 0  # nothing opened yet
        await third._opened_journal()
        assert third.pending == 2
        assert await third.replay() == 2
        assert await _totals(client) == totals  # ...and changes nothing
        await third.aclose()
        await client.aclose()

    asyncio.run(main())


def test_a_replayed_record_settles_its_reservation_after_a_hang(restartable_redis: RedisServer,
                                                                tmp_path: Path) -> None:
    tenant = Tenant("acme", "acme", tokens_per_day=1000)

    async def main() -> None:
        client = connect(restartable_redis.url)
        quotas, meter = Quotas(client), Meter(client, tmp_path / "gw.jsonl", replay_interval_s=60)
        used = await quotas.admit(tenant, "r1", prompt_tokens=20, max_tokens=400)
        unused = await quotas.admit(tenant, "r2", prompt_tokens=30, max_tokens=100)
        counter = rk.tokens_day("acme", used.day)
        assert int(await client.get(counter)) == 420 + 130
        restartable_redis.pause()  # Redis hangs: each call gives up after its 1 s timeout
        t0 = time.monotonic()
        assert await meter.record(_usage("r1"), used)
        assert await meter.release(unused)
        assert time.monotonic() - t0 < 4
        assert meter.pending == 2
        restartable_redis.resume()
        assert await meter.replay() == 2
        assert int(await client.get(counter)) == 20 + 150  # exactly what was used; r2 fully returned
        assert await meter.replay() == 0 and int(await client.get(counter)) == 170
        await meter.aclose()
        await client.aclose()

    asyncio.run(main())


class _Entry(msgspec.Struct):
    n: int


def test_the_journal_is_locked_per_gateway_skips_a_torn_line_and_adopts_orphans(tmp_path: Path) -> None:
    mine = UsageJournal.open_in(tmp_path, _Entry)
    other = UsageJournal.open_in(tmp_path, _Entry)
    assert (mine.path.name, other.path.name) == ("gateway-0.jsonl", "gateway-1.jsonl")
    with pytest.raises(EdgeServeError, match="in use"):
        UsageJournal(mine.path, _Entry)
    other.append("a", _Entry(1))
    other.append("b", _Entry(2))
    other.settle("a")
    other.close()  # its gateway is gone
    with open(other.path, "ab") as f:
        f.write(b'{"key": "c", "entry": {"n"')  # a crash mid-write
    assert mine.adopt_orphans() == 1
    assert mine.pending() == [("b", _Entry(2))]
    mine.close()
    reopened = UsageJournal(mine.path, _Entry)
    assert reopened.pending() == [("b", _Entry(2))]
    reopened.settle("b")
    assert reopened.compact() and reopened.path.stat().st_size == 0
    reopened.close()
    assert UsageJournal(other.path, _Entry).pending() == []
