"""A gateway's cached view of the live workers of each model (read from `backend/registration.py`).

Refreshed at most every `refresh_s` (one SMEMBERS + one MGET per model); ids whose
record expired are skipped (and pruned from the member set), so nothing is routed
to a worker that stopped heartbeating. `StaticView` serves a fixed worker list
from the configuration instead (no load data), for deployments without registration.
"""

from __future__ import annotations

import time

import msgspec
import redis.asyncio as aioredis

from backend.registration import WorkerRecord, members_key, record_key
from gateway.redis_keys import redis_errors

__all__ = ["RegistryView", "StaticView"]

_decode = msgspec.json.Decoder(WorkerRecord).decode


class RegistryView:
    def __init__(self, redis: aioredis.Redis, refresh_s: float = 0.5) -> None:
        self.redis, self.refresh_s = redis, refresh_s
        self._cache: dict[str, tuple[float, list[WorkerRecord]]] = {}

    async def workers(self, model: str) -> list[WorkerRecord]:
        now = time.monotonic()
        hit = self._cache.get(model)
        if hit is not None and now - hit[0] < self.refresh_s:
            return hit[1]
        with redis_errors():
            ids = sorted(m.decode() if isinstance(m, bytes) else m for m in await self.redis.smembers(members_key(model)))
            raw = await self.redis.mget([record_key(model, i) for i in ids]) if ids else []
            expired = [i for i, r in zip(ids, raw) if r is None]
            if expired:
                await self.redis.srem(members_key(model), *expired)
        records = [_decode(r) for r in raw if r is not None]
        self._cache[model] = (now, records)
        return records

    def invalidate(self) -> None:
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
