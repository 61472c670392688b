"""The cluster's KV store as a second prefix-cache tier: put full prompt blocks, fetch them on a miss.

    key   = "edgeserve-kv/<namespace>/<chained block hash hex>"
    value = one object per full block (`kv_store_codec.py`): header with the block's token
            ids, the page's raw bytes of every layer in the pool's format, crc32

The namespace (`kv_store_keys.py`) hashes what the bytes depend on: the model, the
compute dtype, the prefill weight format, and the pool's format and geometry, so pools
that share it take each other's pages byte for byte. The block hash is the
tenant-salted chained hash of `prefix_cache.hashing`: the salt is inside it, so a
tenant's request can only ever name its own tenant's blocks, and the chain means a key
also pins every token before the block.

**Puts happen after prefill**, not on eviction. When a prompt's KV is complete
(`Scheduler.prompt_listeners`), its full blocks that were computed here (not those it
got from a cache) are queued for a background thread, which drops blocks the store
already holds, reads the pages (their generation tags checked before and after the
read, as `LLMEngine.read_kv` does: a page that changed hands meanwhile is not put) and
puts them. After prefill, because the point of the tier is that *another* worker's
next request hits, which an on-eviction put would delay until this worker runs short
of pages (possibly never, for a hot prefix, while every other worker recomputes it);
and eviction runs inside admission on the engine thread, the worst place to wait for a
copy. The cost is bandwidth for blocks nobody reuses; the queue is bounded (`put_queue`)
and a put that finds it full is dropped and counted, never waited for.

**Fetches happen before admission.** `prefetch(seq)` (any thread, when the request
arrives) counts the leading blocks the local prefix cache holds and, if full blocks
follow, hands the next ones to the fetch thread: one `exists` query, then `get`s in
chunks of `fetch_chunk` blocks, each block verified (`decode_block`: checksum, header,
token ids; a bad object is removed from the store and the chain stops there). The
request waits at most `fetch_timeout_s` (default 150 ms) in all: at the deadline the
engine thread takes whatever blocks arrived verified and the rest is recomputed.
`install` (engine thread, right before `Scheduler.add`) copies them into freshly
allocated pages and inserts them into the local prefix cache as this worker's own
blocks, so the normal admission `match` hits them. A store that is down, slow or not
connected is skipped: a failed query, or a deadline that passes before the store
answered at all, skips the store for `retry_s`, so an outage costs one bounded wait,
not one per request. Nothing here ever fails a request.

Blocks the store holds are reported as `KVEvent(..., tier="store")` through the prefix
cache's sink, so the routers' index knows about them (`prefix_cache/kv_events.py`).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from backend.errors import InvalidRequest
from backend.kv_store_codec import BlockLayout, BlockRejected, block_layout, decode_block, encode_block, read_pages, \
    write_pages
from backend.kv_store_keys import block_key, store_namespace
from backend.prefix_cache_pool import KVEvent
from backend.sequence import Sequence

__all__ = ["StoreClient", "StoreFetch", "KVStoreTier", "open_store_tier", "DEFAULT_FETCH_TIMEOUT_S"]

log = logging.getLogger(__name__)

DEFAULT_FETCH_TIMEOUT_S = 0.15


class StoreClient(Protocol):
    """What the tier needs of a store (`kv_store_client.MooncakeStoreClient`); failures raise."""

    @property
    def ready(self) -> bool: ...
    def exists(self, keys: list[str]) -> list[bool]: ...
    def get(self, keys: list[str]) -> list[bytes]: ...
    def put(self, keys: list[str], values: list[bytes]) -> None: ...
    def remove(self, key: str) -> bool: ...
    def close(self) -> None: ...


class StoreFetch:
    """One request's blocks on their way from the store: filled by the fetch thread, taken once by the
    engine thread (`take`), after which late blocks are discarded."""

    def __init__(self, seq: Sequence, start: int, deadline: float, on_done: Callable[[], None]) -> None:
        self.seq, self.start, self.deadline = seq, start, deadline  # blocks [start, ...) of seq
        self.blocks: list[memoryview] = []  # verified payloads, in order
        self.answered = False  # the store replied to the existence query
        self.done = threading.Event()
        self._on_done = on_done
        self._lock = threading.Lock()
        self._taken = False

    def add(self, payload: memoryview) -> bool:
        """Fetch thread: append a verified block; False once the engine thread has taken the fetch."""
        with self._lock:
            if self._taken:
                return False
            self.blocks.append(payload)
            return True

    @property
    def taken(self) -> bool:
        return self._taken

    def finish(self) -> None:
        self.done.set()
        self._on_done()

    def take(self) -> list[memoryview]:
        """Engine thread: the blocks verified so far; nothing is added after this."""
        with self._lock:
            self._taken = True
            return list(self.blocks)


class _PutJob(NamedTuple):
    hashes: list[bytes]
    tokens: list[list[int]]
    pages: list[int]
    tags: list[int]


class KVStoreTier:
    """A worker's second prefix-cache tier (see the module docstring). `attach` binds it to an engine
    with a prefix cache; `prefetch` (any thread) and `install` (engine thread) serve a request's
    misses; puts run by themselves after each prefill. `stats` counts everything that happened."""

    def __init__(self, client: StoreClient, namespace: str, *, fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S,
                 fetch_chunk: int = 16, put_queue: int = 64, retry_s: float = 5.0) -> None:
        self.client, self.namespace = client, namespace
        self.fetch_timeout_s, self.fetch_chunk, self.retry_s = fetch_timeout_s, fetch_chunk, retry_s
        self.engine: Any = None
        self.layout: BlockLayout | None = None
        self._fetches: queue.Queue[StoreFetch | None] = queue.Queue()
        self._puts: queue.Queue[_PutJob | None] = queue.Queue(maxsize=put_queue)
        self._skip_until = 0.0  # monotonic: the store is skipped until then (it failed or did not answer)
        self._current: StoreFetch | None = None  # the fetch the fetch thread works on
        self._threads: list[threading.Thread] = []
        self._closed = False
        self.stats: dict[str, int] = dict.fromkeys((
            "fetches", "fetch_hit_blocks", "fetch_miss", "fetch_timeouts", "fetch_errors", "skipped_not_ready",
            "skipped_down", "skipped_busy", "imported_blocks", "rejected_checksum", "rejected_tokens",
            "rejected_header", "rejected_malformed", "put_blocks", "put_existing", "put_dropped_queue_full",
            "put_dropped_changed_hands", "put_errors"), 0)

    # -- wiring -------------------------------------------------------------------------
    def attach(self, engine: Any) -> KVStoreTier:
        """Serve `engine` (needs its prefix cache): hear of every computed prompt, start the threads."""
        if engine.scheduler.prefix_cache is None:
            raise InvalidRequest("the KV store tier needs prefix caching (--prefix-caching)")
        self.engine, self.layout = engine, block_layout(engine.cache)
        engine.scheduler.prompt_listeners.append(self.offer)
        for name, target in (("fetch", self._fetch_loop), ("put", self._put_loop)):
            t = threading.Thread(target=target, name=f"edgeserve-kv-store-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def key(self, block_hash: bytes) -> str:
        return block_key(self.namespace, block_hash)

    def close(self) -> None:
        """Stop the threads (work queued is dropped) and the client."""
        self._closed = True
        self._fetches.put(None)
        with contextlib.suppress(queue.Full):  # a full queue: the loop sees `_closed` at its next job
            self._puts.put_nowait(None)
        self.client.close()

    def snapshot(self) -> dict[str, object]:
        """Counters and state, for a worker's /stats."""
        return {"namespace": self.namespace, "ready": self.client.ready,
                "skipping_s": round(max(0.0, self._skip_until - time.monotonic()), 3), **self.stats}

    def _usable(self, count_as: str | None) -> bool:
        if not self.client.ready:
            if count_as:
                self.stats["skipped_not_ready"] += 1
            return False
        if time.monotonic() < self._skip_until:
            if count_as:
                self.stats["skipped_down"] += 1
            return False
        return True

    def _store_failed(self, why: str) -> None:
        if time.monotonic() >= self._skip_until:
            log.warning("KV store skipped for %.0f s: %s", self.retry_s, why)
        self._skip_until = time.monotonic() + self.retry_s

    # -- fetch on a local miss ---------------------------------------------------------------
    def prefetch(self, seq: Sequence, on_done: Callable[[], None]) -> StoreFetch | None:
        """Any thread, before `seq` is queued: start fetching the full blocks that follow its locally
        cached prefix, or None when there is nothing to fetch or the store is not usable now.
        `on_done` is called (fetch thread) when the fetch has finished."""
        cache = self.engine.scheduler.prefix_cache
        if not seq.block_hashes or seq.params.prompt_logprobs is not None:
            return None
        limit = (seq.num_prompt_tokens - 1) // self.engine.config.page_size  # admission never shares the last token
        start = cache.leading_cached(seq.block_hashes, limit)
        if start >= limit or not self._usable("count"):
            return None
        current = self._current
        if current is not None and time.monotonic() > current.deadline:  # the fetch thread is stuck in a call
            self.stats["skipped_busy"] += 1
            return None
        fetch = StoreFetch(seq, start, time.monotonic() + self.fetch_timeout_s, on_done)
        self.stats["fetches"] += 1
        self._fetches.put(fetch)
        return fetch

    def _fetch_loop(self) -> None:
        while (fetch := self._fetches.get()) is not None:
            self._current = fetch
            try:
                if not fetch.taken and time.monotonic() < fetch.deadline:
                    self._fetch(fetch)
            except Exception as exc:  # noqa: BLE001 - a store failure only means recompute
                self.stats["fetch_errors"] += 1
                self._store_failed(f"fetch failed: {exc}")
            finally:
                self._current = None
                fetch.finish()

    def _fetch(self, fetch: StoreFetch) -> None:
        seq, bs = fetch.seq, self.engine.config.page_size
        limit = (seq.num_prompt_tokens - 1) // bs
        hashes = seq.block_hashes[fetch.start:limit]
        keys = [self.key(h) for h in hashes]
        present = self.client.exists(keys)
        fetch.answered = True
        n = next((i for i, p in enumerate(present) if not p), len(present))
        if n < len(present):  # the routers' index may still name it (the store evicts silently)
            self._report("removed", [hashes[n]])
        if n == 0:
            self.stats["fetch_miss"] += 1
            return
        got = 0
        try:
            for lo in range(0, n, self.fetch_chunk):
                if fetch.taken:
                    return
                chunk = keys[lo:min(n, lo + self.fetch_chunk)]
                for j, data in enumerate(self.client.get(chunk)):
                    i = fetch.start + lo + j
                    if not data:  # evicted since the existence query
                        self._report("removed", [hashes[lo + j]])
                        return
                    try:
                        payload = decode_block(data, self.namespace, seq.block_hashes[i],
                                               seq.prompt_ids[i * bs:(i + 1) * bs], self.layout)
                    except BlockRejected as exc:
                        self.stats[f"rejected_{exc.reason}"] += 1
                        log.warning("KV store: block %s rejected (%s): %s; it is removed and recomputed", chunk[j],
                                    exc.reason, exc)
                        self.client.remove(chunk[j])
                        self._report("removed", [hashes[lo + j]])
                        return
                    if not fetch.add(payload):
                        return
                    got += 1
                    self.stats["fetch_hit_blocks"] += 1
        finally:
            if got:  # hot blocks stay in the routers' index (their entries expire otherwise)
                self._report("stored", hashes[:got])

    def _report(self, kind: str, hashes: list[bytes]) -> None:
        """A store-tier KV event, through the prefix cache's sink (any thread)."""
        self.engine.scheduler.prefix_cache.report(KVEvent(kind, list(hashes), "store"))

    def install(self, fetch: StoreFetch) -> int:
        """Engine thread, right before the request is queued: copy the blocks that arrived in time into
        fresh pages and insert them into the prefix cache as this worker's own; return how many."""
        blocks = fetch.take()
        if not fetch.done.is_set():
            self.stats["fetch_timeouts"] += 1
            if not fetch.answered:
                self._store_failed(f"no answer within {self.fetch_timeout_s * 1000:.0f} ms")
        if not blocks:
            return 0
        try:
            return self._install(fetch.seq, fetch.start, blocks)
        except Exception:  # noqa: BLE001 - never fail the request (nor the engine thread): recompute instead
            log.exception("KV store: installing fetched blocks failed; recomputing them")
            return 0

    def _install(self, seq: Sequence, start: int, blocks: list[memoryview]) -> int:
        engine, bs = self.engine, self.engine.config.page_size
        cache, allocator = engine.scheduler.prefix_cache, engine.allocator
        todo = [i for i in range(start, start + len(blocks)) if seq.block_hashes[i] not in cache]
        if not todo:
            return 0
        short = len(todo) - allocator.num_free
        if short > 0:  # make room from cold cached blocks, never from this prompt's own
            cache.evict(short, keep=set(seq.block_hashes[:start + len(blocks)]))
        todo = todo[:allocator.num_free]
        pages = allocator.try_allocate(len(todo)) if todo else None
        if not pages:
            return 0
        tags = allocator.tags_of(pages)
        try:
            write_pages(engine.cache, pages, [blocks[i - start] for i in todo])
            if allocator.tags_of(pages) != tags:  # cannot happen while we hold them; never insert if it did
                log.error("KV store: pages %s changed hands while fetched blocks were installed", pages)
                return 0
            cache.insert_blocks([seq.block_hashes[i] for i in todo],
                                [seq.prompt_ids[i * bs:(i + 1) * bs] for i in todo], pages)
        finally:  # our own reference goes; the cache's keeps the inserted blocks
            allocator.release([p for p, t, now in zip(pages, tags, allocator.tags_of(pages)) if t == now])
        self.stats["imported_blocks"] += len(todo)
        return len(todo)

    # -- put after prefill ---------------------------------------------------------------------
    def offer(self, seq: Sequence) -> None:
        """Engine thread, when `seq`'s prompt is complete: queue its full blocks computed here for a put
        (never waits: a full queue drops the put and counts it)."""
        try:
            first, n = seq.num_cached_tokens // self.engine.config.page_size, len(seq.block_hashes)
            if first >= n or not self._usable(None):
                return
            bs = self.engine.config.page_size
            job = _PutJob(seq.block_hashes[first:n], [seq.prompt_ids[i * bs:(i + 1) * bs] for i in range(first, n)],
                          seq.page_ids[first:n], seq.page_tags[first:n])
            self._puts.put_nowait(job)
        except queue.Full:
            self.stats["put_dropped_queue_full"] += 1
        except Exception:  # noqa: BLE001 - a listener must never fail the step
            log.exception("KV store: could not queue a put")

    def _put_loop(self) -> None:
        while (job := self._puts.get()) is not None and not self._closed:
            try:
                if self._usable(None):
                    self._put(job)
            except Exception as exc:  # noqa: BLE001 - a failed put only costs a later recompute
                self.stats["put_errors"] += 1
                self._store_failed(f"put failed: {exc}")
            finally:
                self._puts.task_done()

    def wait_puts(self, timeout_s: float) -> bool:
        """Block until every put queued so far is done (True), or `timeout_s` passed (False)."""
        deadline = time.monotonic() + timeout_s
        while self._puts.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def _put(self, job: _PutJob) -> None:
        keys = [self.key(h) for h in job.hashes]
        present = self.client.exists(keys)
        self.stats["put_existing"] += sum(present)
        todo = [i for i, p in enumerate(present) if not p]
        if not todo:
            return
        allocator = self.engine.allocator
        pages = [job.pages[i] for i in todo]
        before = allocator.tags_of(pages)
        rows = read_pages(self.engine.cache, pages)
        after = allocator.tags_of(pages)
        keep = [k for k, i in enumerate(todo) if before[k] == after[k] == job.tags[i]]
        self.stats["put_dropped_changed_hands"] += len(todo) - len(keep)
        if not keep:
            return
        objects = [encode_block(self.namespace, job.hashes[todo[k]], job.tokens[todo[k]], self.layout, rows[k])
                   for k in keep]
        hashes = [job.hashes[todo[k]] for k in keep]
        self.client.put([keys[todo[k]] for k in keep], objects)
        self.stats["put_blocks"] += len(keep)
        self._report("stored", hashes)


def open_store_tier(engine: Any, master: str, model_id: str, *, host: str = "127.0.0.1",
                    segment_bytes: int = 512 << 20, fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S) -> KVStoreTier:
    """A tier on the Mooncake master at `master` ("host:port") for `engine`, attached. The client
    connects in the background; until then requests are computed as without a store."""
    from backend.kv_store_client import MooncakeStoreClient

    namespace = store_namespace(engine, model_id)  # refuses a tensor-parallel engine before connecting
    client = MooncakeStoreClient(master, host, segment_bytes)
    return KVStoreTier(client, namespace, fetch_timeout_s=fetch_timeout_s).attach(engine)
