"""Workers register themselves in Redis and heartbeat their live load; gateways read it to route.

    edgeserve:{m:<model>}:workers                 set of worker ids serving the model
    edgeserve:{m:<model>}:worker:<id>:record      WorkerRecord (JSON), expires after `ttl_s`

Each heartbeat rewrites the record with a fresh expiry, so a worker that stops
answering (crash, partition, SIGKILL) drops out of every gateway's view within
`ttl_s` without anyone deleting it; a worker that stops cleanly deletes its record.
Readers skip ids whose record has expired (and remove them, with their prefix-index
entries: `prefix_cache.kv_events.forget_worker`). Keys of one model share a hash tag.
The Redis client has 1 s connect and reply timeouts (`backend.redis_client`); while
Redis is away the worker keeps serving, retries every beat, and logs the outage once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import msgspec
from redis import RedisError

from backend.redis_client import OutageLog, connect

__all__ = ["WorkerRecord", "record_key", "members_key", "Heartbeat"]

log = logging.getLogger(__name__)


class WorkerRecord(msgspec.Struct, frozen=True):
    id: str
    url: str
    role: str  # "unified" | "prefill" | "decode"
    model: str
    region: str
    page_size: int
    pages_total: int
    pages_free: int
    running: int
    waiting: int
    queued_prefill_tokens: int  # prompt tokens admitted or queued but not yet computed (cached prefixes not counted)
    pages_evictable: int = 0  # pages held only by the prefix cache: free for the taking (LRU eviction)
    kv_store: bool = False  # fetches prompt blocks from the cluster's KV store (`serve --kv-store`)
    updated_at: float = 0.0


def members_key(model: str) -> str:
    return f"edgeserve:{{m:{model}}}:workers"


def record_key(model: str, worker_id: str) -> str:
    return f"edgeserve:{{m:{model}}}:worker:{worker_id}:record"


class Heartbeat:
    """Publishes `record()` every `interval_s` with a `ttl_s` expiry (run as a task in the worker's loop)."""

    def __init__(self, redis_url: str, record: Callable[[], WorkerRecord], interval_s: float = 1.0,
                 ttl_s: float = 3.0) -> None:
        self.redis = connect(redis_url)
        self.record, self.interval_s, self.ttl_s = record, interval_s, ttl_s
        self._outage = OutageLog(log, "Redis (worker registry)")

    async def beat(self) -> WorkerRecord:
        rec = msgspec.structs.replace(self.record(), updated_at=time.time())
        pipe = self.redis.pipeline(transaction=True)
        pipe.set(record_key(rec.model, rec.id), msgspec.json.encode(rec), px=int(self.ttl_s * 1000))
        pipe.sadd(members_key(rec.model), rec.id)
        await pipe.execute()
        return rec

    async def run(self) -> None:
        rec = self.record()
        try:
            while True:
                try:
                    rec = await self.beat()
                    self._outage.ok()
                except (RedisError, OSError) as exc:  # Redis away: keep serving, retry next beat
                    self._outage.failed(exc)
                except Exception:  # noqa: BLE001 - a bad record must not stop the beat either
                    log.exception("heartbeat failed")
                await asyncio.sleep(self.interval_s)
        finally:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._withdraw(rec))

    async def _withdraw(self, rec: WorkerRecord) -> None:
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(record_key(rec.model, rec.id))
        pipe.srem(members_key(rec.model), rec.id)
        await pipe.execute()
        await self.redis.aclose()
