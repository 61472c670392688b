"""The end of a soak: waiting until every worker is idle with every page back and the tenants' usage
counters have stopped moving, then reading the metering (and, for admitted requests without a usage
event, whether their idempotency marker was set)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from ops.bench.soak.checks import TenantMetering, leaked_pages
from ops.bench.soak.cluster import Cluster
from ops.bench.soak.traffic import Tenant

__all__ = ["wait_idle", "read_metering", "wait_settled", "diagnose_missing"]


async def wait_idle(cluster: Cluster, cap_s: float) -> dict[str, dict[str, Any]]:
    """Poll every worker's /stats until nothing runs, waits or is held and every page is back
    (cached blocks nobody reads count as free), or `cap_s` passes; the last snapshots."""
    import httpx

    deadline = time.perf_counter() + cap_s
    async with httpx.AsyncClient(timeout=5, headers=cluster.auth) as client:
        while True:
            snaps: dict[str, dict[str, Any]] = {}
            for name, url in cluster.worker_urls.items():
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    snaps[name] = (await client.get(f"{url}/stats")).json()
            idle = len(snaps) == len(cluster.worker_urls) and all(
                s["running"] == s["waiting"] == s.get("held", 0) == 0 and leaked_pages(s) == 0
                for s in snaps.values())
            if idle or time.perf_counter() > deadline:
                return snaps
            await asyncio.sleep(0.5)


def read_metering(redis_url: str, tenants: dict[str, Tenant], days: list[str]) -> dict[str, TenantMetering]:
    """Every tenant's usage counters summed over `days` (all models) and its usage events' request ids."""
    import redis

    from gateway import redis_keys as rk

    client = redis.Redis.from_url(redis_url, decode_responses=True, socket_timeout=5)
    try:
        out = {}
        for name, t in tenants.items():
            m = TenantMetering()
            for day in days:
                for field, value in client.hgetall(rk.usage(t.id, day)).items():
                    metric = field.rpartition("|")[2]
                    if metric == "requests":
                        m.requests += int(value)
                    elif metric == "completion_tokens":
                        m.completion_tokens += int(value)
            m.request_ids = {fields["request_id"] for _, fields in client.xrange(rk.usage_events(t.id))}
            out[name] = m
        return out
    finally:
        client.close()


def wait_settled(redis_url: str, tenants: dict[str, Tenant], days: list[str], cap_s: float,
                 quiet_s: float = 4.0) -> dict[str, TenantMetering]:
    """Read the metering until no counter has moved for `quiet_s` (gateways have replayed any
    journal), or `cap_s` passes."""
    deadline, last, since = time.perf_counter() + cap_s, None, time.perf_counter()
    while True:
        now = read_metering(redis_url, tenants, days)
        key = {n: (m.requests, m.completion_tokens, len(m.request_ids)) for n, m in now.items()}
        if key != last:
            last, since = key, time.perf_counter()
        elif time.perf_counter() - since >= quiet_s or time.perf_counter() > deadline:
            return now
        time.sleep(1.0)


def diagnose_missing(redis_url: str, tenants: dict[str, Tenant], missing: dict[str, set[str]]) -> dict[str, Any]:
    """For admitted requests without a usage event: is their idempotency marker set (settled as a
    release, or a record that was skipped) or absent (never reached Redis)?"""
    import redis

    from gateway import redis_keys as rk

    client = redis.Redis.from_url(redis_url, socket_timeout=5)
    try:
        return {name: {"marker_set": sorted(i for i in ids if client.exists(rk.metered(tenants[name].id, i))),
                       "no_marker": sorted(i for i in ids if not client.exists(rk.metered(tenants[name].id, i)))}
                for name, ids in missing.items() if ids and name in tenants}
    finally:
        client.close()
