"""Which worker holds which prefix blocks, in Redis, built from the workers' own KV events.

Each worker with a prefix cache reports every block it stores or evicts
(`backend/prefix_cache_pool.py` -> `KVEvent`); `KVEventPublisher` applies them to
the index in batches (every `interval_s`, one MULTI/EXEC pipeline), so the index
follows the caches exactly, a batch behind:

    edgeserve:{m:<model>}:block:<hash hex>          set of worker ids holding that block
    edgeserve:{m:<model>}:worker:<id>:blocks        set of block hashes a worker holds
    edgeserve:{m:<model>}:store-block:<hash hex>    "1" while the cluster's KV store holds it (expires)
    edgeserve:{m:<model>}:kv-events                 stream of the raw events (audit), capped

**Tiers.** An event names the tier holding its blocks (`KVEvent.tier`; events without
the field, from older workers, are "local"). "local" blocks are a worker's own pool and
go in the sets above. "store" blocks are in the cluster-wide KV store
(`backend/kv_store_tier.py`), which any worker with a store can fetch from: they are
not any worker's, so they are not withdrawn when a worker stops, and since the store
evicts on its own without telling anyone, each entry expires `store_ttl_s` after the
last put or hit that reported it (a worker that finds a block gone reports its
removal). An entry may thus outlive its block by up to that long: the router then
counts a store hit that turns into a recompute, and the worker's bounded fetch finds
out. The stream's entries carry a `tier` field.

All keys of one model share the hash tag `{m:<model>}` (one Redis Cluster slot,
so a batch is one transaction). On start, and when it stops, a worker withdraws
everything it had published (its cache starts empty and dies with it). A worker
that dies without withdrawing is cleaned up by the gateways' registry view once
its record has expired (`forget_worker`).

**When Redis is away** a batch that fails is kept and re-sent, in order, before
newer events (the set operations are idempotent, so a batch that did land but
whose reply was lost does no harm). The index is **stale** when events were lost:
more than `max_unsent` waiting for Redis (they are dropped), or the engine's own
event queue overflowed (`dropped()` grew). A stale index is rebuilt at the next
flush that reaches Redis: the worker withdraws all its entries, then asks the
engine to report its whole cache again (`resync()`, if given). Without a resync
hook the index under-reports that worker until blocks are stored again; it never
names blocks the worker does not hold, and hits are re-verified by the worker anyway.

`PrefixIndex.overlap` answers a router's question: for a request's block hashes,
how many leading blocks does each worker hold? When Redis cannot answer it
returns no overlap (the router then ranks by load) and skips the index for
`retry_s`, so a hung Redis costs one timeout per `retry_s`, not one per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import NamedTuple

import redis.asyncio as aioredis
from redis import RedisError

from backend.redis_client import OutageLog, connect
from backend.redis_lane import run_pipeline
from backend.registration import members_key, record_key

__all__ = ["block_key", "worker_blocks_key", "store_block_key", "events_key", "forget_worker", "KVEventPublisher",
           "PrefixIndex", "TierOverlap", "EVENTS_MAXLEN", "MAX_UNSENT_EVENTS", "STORE_TTL_S"]

log = logging.getLogger(__name__)
EVENTS_MAXLEN = 100_000
MAX_UNSENT_EVENTS = 50_000  # events held for Redis while it is away; past this the index goes stale
STORE_TTL_S = 600  # a store-tier entry expires this long after the last event that reported the block

# KEYS: the worker's record, the model's member set, the worker's block set. ARGV: worker id, block key prefix.
# Returns -1 when the worker is alive (record present), else how many blocks it was removed from.
_FORGET = """
if redis.call('EXISTS', KEYS[1]) == 1 then return -1 end
redis.call('SREM', KEYS[2], ARGV[1])
local hashes = redis.call('SMEMBERS', KEYS[3])
for _, h in ipairs(hashes) do redis.call('SREM', ARGV[2] .. h, ARGV[1]) end
redis.call('DEL', KEYS[3])
return #hashes
"""


def _tag(model: str) -> str:
    return f"edgeserve:{{m:{model}}}"


def block_key(model: str, block_hash: bytes) -> str:
    return f"{_tag(model)}:block:{block_hash.hex()}"


def worker_blocks_key(model: str, worker_id: str) -> str:
    return f"{_tag(model)}:worker:{worker_id}:blocks"


def store_block_key(model: str, block_hash: bytes) -> str:
    return f"{_tag(model)}:store-block:{block_hash.hex()}"


def events_key(model: str) -> str:
    return f"{_tag(model)}:kv-events"


async def forget_worker(redis: aioredis.Redis, model: str, worker_id: str) -> int:
    """Remove a dead worker (no live record) from the registry and the prefix index, atomically.

    Returns how many blocks it was removed from, or -1 (nothing changed) when its record exists."""
    return int(await redis.eval(_FORGET, 3, record_key(model, worker_id), members_key(model),
                                worker_blocks_key(model, worker_id), worker_id, f"{_tag(model)}:block:"))


class KVEventPublisher:
    """Drains a worker's KV events into the Redis index (run as a task in the worker's event loop)."""

    def __init__(self, redis_url: str, model: str, worker_id: str, events: deque, interval_s: float = 0.02, *,
                 dropped: Callable[[], int] | None = None, resync: Callable[[], None] | None = None,
                 max_unsent: int = MAX_UNSENT_EVENTS, store_ttl_s: int = STORE_TTL_S) -> None:
        """`dropped`: how many events the engine has dropped so far (its queue is bounded); `resync`:
        asks the engine to report every block it caches as one "stored" event (engine thread-safe);
        `store_ttl_s`: how long a store-tier entry lives after the last event that reported it."""
        self.redis = connect(redis_url)
        self.store_ttl_s = store_ttl_s
        self.model, self.worker_id, self.events, self.interval_s = model, worker_id, events, interval_s
        self._dropped, self._resync, self.max_unsent = dropped, resync, max_unsent
        self._dropped_seen = dropped() if dropped is not None else 0
        self._unsent: list = []  # events of batches Redis did not take, oldest first
        self.stale = False  # True: withdraw everything (and resync) before the next batch
        self.published = 0
        self._outage = OutageLog(log, f"Redis (prefix index of {worker_id})")

    async def run(self) -> None:
        """Publish until cancelled (withdrawing leftovers first); withdraw again on the way out."""
        self.stale = True  # a restarted worker's entries from its last life go first
        try:
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
        """Apply queued events (re-sending any batch Redis missed first, rebuilding a stale index);
        return how many were applied now."""
        if self._dropped is not None and (seen := self._dropped()) != self._dropped_seen:
            self._dropped_seen = seen
            self._mark_stale("the engine dropped KV events (its queue overflowed)")
        batch = self._unsent
        while self.events:
            batch.append(self.events.popleft())
        self._unsent = []
        try:
            if self.stale:
                await self.withdraw()
                self.stale = False
                if self._resync is not None:
                    self._resync()
            if batch:
                await self._apply(batch)
        except (RedisError, OSError) as exc:
            self._outage.failed(exc)
            if len(batch) > self.max_unsent:
                self._mark_stale(f"{len(batch)} KV events waited for Redis")
            else:
                self._unsent = batch
            return 0
        self._outage.ok()
        self.published += len(batch)
        return len(batch)

    def _mark_stale(self, why: str) -> None:
        log.warning("prefix index of worker %s is stale (%s): it is rebuilt when Redis is reachable", self.worker_id,
                    why)
        self.stale = True
        self._unsent = []

    async def _apply(self, batch: list) -> None:
        mine = worker_blocks_key(self.model, self.worker_id)
        pipe = self.redis.pipeline(transaction=True)
        for ev in batch:
            tier = getattr(ev, "tier", "local")  # events of older producers have no tier: their own pool
            for h in ev.hashes:
                if tier == "store":
                    if ev.kind == "stored":
                        pipe.set(store_block_key(self.model, h), 1, ex=self.store_ttl_s)
                    else:
                        pipe.delete(store_block_key(self.model, h))
                elif ev.kind == "stored":
                    pipe.sadd(block_key(self.model, h), self.worker_id)
                    pipe.sadd(mine, h.hex())
                else:
                    pipe.srem(block_key(self.model, h), self.worker_id)
                    pipe.srem(mine, h.hex())
            pipe.xadd(events_key(self.model), {"worker": self.worker_id, "kind": ev.kind,
                                               "hashes": ",".join(h.hex() for h in ev.hashes), "tier": tier},
                      maxlen=EVENTS_MAXLEN, approximate=True)
        await pipe.execute()

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


class TierOverlap(NamedTuple):
    """How much of a request's prefix each tier holds, in leading blocks."""

    local: dict[str, int]  # worker id -> leading blocks in its own pool
    store: int  # leading blocks in the cluster's KV store


class PrefixIndex:
    """Router side: read the index; no overlap (rank by load) while Redis cannot answer."""

    def __init__(self, redis: aioredis.Redis, retry_s: float = 2.0) -> None:
        self.redis, self.retry_s = redis, retry_s
        self._skip_until = 0.0
        self._outage = OutageLog(log, "Redis (prefix index; routing by load meanwhile)")

    async def overlap(self, model: str, hashes: Sequence[bytes]) -> dict[str, int]:
        """For each worker holding the first block: how many leading blocks of `hashes` it holds."""
        return (await self.overlap_tiers(model, hashes, store=False)).local

    async def overlap_tiers(self, model: str, hashes: Sequence[bytes], store: bool = True) -> TierOverlap:
        """`overlap` per worker, and how many leading blocks of `hashes` the KV store holds (one round trip)."""
        if not hashes or time.monotonic() < self._skip_until:
            return TierOverlap({}, 0)
        commands = [("SMEMBERS", block_key(model, h)) for h in hashes]
        if store:
            commands += [("EXISTS", store_block_key(model, h)) for h in hashes]
        try:
            replies = await run_pipeline(self.redis, commands)
        except (RedisError, OSError) as exc:
            self._outage.failed(exc)
            self._skip_until = time.monotonic() + self.retry_s
            return TierOverlap({}, 0)
        self._outage.ok()
        n = len(hashes)
        holders = [{m.decode() if isinstance(m, bytes) else m for m in s} for s in replies[:n]]
        result: dict[str, int] = {}
        current = holders[0]
        for i, members in enumerate(holders):
            current = current & members
            if not current:
                break
            for w in current:
                result[w] = i + 1
        in_store = next((i for i, e in enumerate(replies[n:]) if not e), len(replies) - n)
        return TierOverlap(result, in_store)
