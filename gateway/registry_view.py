"""A gateway's cached view of the live workers of each model (read from `backend/registration.py`).

Refreshed at most every `refresh_s` (one SMEMBERS + one MGET per model); ids whose
record expired are skipped, so nothing is routed to a worker that stopped
heartbeating. A dead worker is also cleaned up: its id leaves the member set and
its prefix-index entries are withdrawn (`prefix_cache.kv_events.forget_worker`,
atomic, and only while its record is still absent), so a worker killed without
withdrawing leaves nothing behind in Redis.

When Redis cannot be read, the last view of the model is served for up to
`stale_s` (routing keeps working through a blip; records expire in seconds, so
not for longer), then `StoreUnavailable` (503).

`StaticView` serves a fixed worker list from the configuration instead (no load
data), for deployments without registration.
"""

from __future__ import annotations

import time

import msgspec
import redis.asyncio as aioredis

from backend.errors import StoreUnavailable
from backend.registration import WorkerRecord, members_key, record_key
from gateway.redis_keys import redis_errors
from prefix_cache.kv_events import forget_worker

__all__ = ["RegistryView", "StaticView"]

_decode = msgspec.json.Decoder(WorkerRecord).decode


class RegistryView:
    """Live workers per model from the Redis registry, cached `refresh_s`, served stale up to `stale_s`."""

    def __init__(self, redis: aioredis.Redis, refresh_s: float = 0.5, stale_s: float = 5.0) -> None:
        self.redis, self.refresh_s, self.stale_s = redis, refresh_s, stale_s
        self._cache: dict[str, tuple[float, list[WorkerRecord]]] = {}

    async def workers(self, model: str) -> list[WorkerRecord]:
        """The model's live workers; the last view within `stale_s` when Redis is away, else StoreUnavailable."""
        now = time.monotonic()
        hit = self._cache.get(model)
        if hit is not None and now - hit[0] < self.refresh_s:
            return hit[1]
        try:
            with redis_errors():
                ids = sorted(m.decode() if isinstance(m, bytes) else m
                             for m in await self.redis.smembers(members_key(model)))
                raw = await self.redis.mget([record_key(model, i) for i in ids]) if ids else []
                for dead in (i for i, r in zip(ids, raw, strict=True) if r is None):
                    await forget_worker(self.redis, model, dead)
        except StoreUnavailable:
            if hit is not None and now - hit[0] < self.stale_s:
                return hit[1]
            raise
        records = [_decode(r) for r in raw if r is not None]
        self._cache[model] = (now, records)
        return records

    def invalidate(self) -> None:
        """Forget every cached view (the next call reads Redis)."""
        self._cache.clear()


class StaticView:
    """Configured workers, all assumed live and idle (role unified, the gateway's region)."""

    def __init__(self, workers: dict[str, list[str]], region: str, page_size: int = 16) -> None:
        self._records = {model: [WorkerRecord(id=url, url=url, role="unified", model=model, region=region,
                                              page_size=page_size, pages_total=0, pages_free=0, running=0,
                                              waiting=0, queued_prefill_tokens=0) for url in urls]
                         for model, urls in workers.items()}

    async def workers(self, model: str) -> list[WorkerRecord]:
        return self._records.get(model, [])
