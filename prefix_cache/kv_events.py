"""Which worker holds which prefix blocks, in Redis, built from the workers' own KV events.

Each worker with a prefix cache reports every block it stores or evicts
(`backend/prefix_cache_pool.py` -> `KVEvent`); `KVEventPublisher` applies them to
the index in batches (every `interval_s`, one MULTI/EXEC pipeline), so the index
follows the caches exactly, a batch behind:

    edgeserve:{m:<model>}:block:<hash hex>          set of worker ids holding that block
    edgeserve:{m:<model>}:worker:<id>:blocks        set of block hashes a worker holds
    edgeserve:{m:<model>}:kv-events                 stream of the raw events (audit, replay)

All keys of one model share the hash tag `{m:<model>}` (one Redis Cluster slot,
so a batch is one transaction). On start, and when it stops, a worker withdraws
everything it had published (its cache starts empty and dies with it).
`PrefixIndex.overlap` answers a router's question: for a request's block hashes,
how many leading blocks does each worker hold?
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Sequence

import redis.asyncio as aioredis

__all__ = ["block_key", "worker_blocks_key", "events_key", "KVEventPublisher", "PrefixIndex"]

log = logging.getLogger(__name__)
EVENTS_MAXLEN = 100_000


def _tag(model: str) -> str:
    return f"edgeserve:{{m:{model}}}"


def block_key(model: str, block_hash: bytes) -> str:
    return f"{_tag(model)}:block:{block_hash.hex()}"


def worker_blocks_key(model: str, worker_id: str) -> str:
    return f"{_tag(model)}:worker:{worker_id}:blocks"


def events_key(model: str) -> str:
    return f"{_tag(model)}:kv-events"


class KVEventPublisher:
    """Drains a worker's KV events into the Redis index (run as a task in the worker's event loop)."""

    def __init__(self, redis_url: str, model: str, worker_id: str, events: deque, interval_s: float = 0.02) -> None:
        self.redis = aioredis.Redis.from_url(redis_url)
        self.model, self.worker_id, self.events, self.interval_s = model, worker_id, events, interval_s
        self.published = 0

    async def run(self) -> None:
        """Withdraw stale entries, then publish until cancelled; withdraw again on the way out."""
        try:
            await self.withdraw()
            while True:
                await self.flush()
                await asyncio.sleep(self.interval_s)
        finally:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._final())

    async def _final(self) -> None:
        self.events.clear()
        await self.withdraw()
        await self.redis.aclose()

    async def flush(self) -> int:
        """Apply every queued event (one transaction); return how many."""
        batch = []
        while self.events:
            batch.append(self.events.popleft())
        if not batch:
            return 0
        mine = worker_blocks_key(self.model, self.worker_id)
        pipe = self.redis.pipeline(transaction=True)
        for ev in batch:
            for h in ev.hashes:
                if ev.kind == "stored":
                    pipe.sadd(block_key(self.model, h), self.worker_id)
                    pipe.sadd(mine, h.hex())
                else:
                    pipe.srem(block_key(self.model, h), self.worker_id)
                    pipe.srem(mine, h.hex())
            pipe.xadd(events_key(self.model), {"worker": self.worker_id, "kind": ev.kind,
                                               "hashes": ",".join(h.hex() for h in ev.hashes)},
                      maxlen=EVENTS_MAXLEN, approximate=True)
        try:
            await pipe.execute()
        except Exception:  # Redis away: the index misses this batch; it is re-sent on reconnect via withdraw
            log.exception("could not publish %d KV events", len(batch))
            return 0
        self.published += len(batch)
        return len(batch)

    async def withdraw(self) -> None:
        """Remove this worker from every block it published."""
        mine = worker_blocks_key(self.model, self.worker_id)
        hashes = await self.redis.smembers(mine)
        pipe = self.redis.pipeline(transaction=True)
        for hx in hashes:
            pipe.srem(block_key(self.model, bytes.fromhex(hx.decode() if isinstance(hx, bytes) else hx)),
                      self.worker_id)
        pipe.delete(mine)
        await pipe.execute()


class PrefixIndex:
    """Router side: read the index."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self.redis = redis

    async def overlap(self, model: str, hashes: Sequence[bytes]) -> dict[str, int]:
        """For each worker holding the first block: how many leading blocks of `hashes` it holds."""
        if not hashes:
            return {}
        pipe = self.redis.pipeline(transaction=False)
        for h in hashes:
            pipe.smembers(block_key(model, h))
        holders = [{m.decode() if isinstance(m, bytes) else m for m in s} for s in await pipe.execute()]
        result: dict[str, int] = {}
        current = holders[0]
        for i, members in enumerate(holders):
            current = current & members
            if not current:
                break
            for w in current:
                result[w] = i + 1
        return result
