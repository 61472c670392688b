"""The engine's prefix cache: full prompt blocks kept in the KV pool and shared by reference.

    hash (prefix_cache.hashing) -> (page id, the block's token ids)     LRU-ordered

A cached block holds one page reference of its own. A request whose prompt starts
with cached blocks shares those pages (one more reference each; the generation tag
is unchanged, so the integrity check keeps passing) and computes only the rest.
Every hit is re-verified against the stored token ids before the page is reused;
a mismatch (a hash collision or a bug) ends the match there.

Eviction: when admission needs pages that are not free, the least recently used
blocks that nobody but the cache references (refcount 1) are released, oldest
first. A block still read by a running request is never evicted. Evicting a block
drops only that block, so a chain can lose its tail first (LRU is updated on every
hit, so tails are older than heads only when they are used less).

Each store and removal is reported through `on_event` (the worker publishes them
to Redis, so routers know exactly which blocks this worker holds). A `KVEvent` names
the tier that holds the blocks: "local" (this pool) or "store" (the cluster-wide
Mooncake Store, `kv_store_tier.py`, which reports its puts through `report`).

Engine thread only, except `leading_cached` and `report` (any thread; see each).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence, Set
from typing import NamedTuple

from backend.page_allocator import PageAllocator

__all__ = ["KVEvent", "PrefixCachePool"]


class KVEvent(NamedTuple):
    kind: str  # "stored" | "removed"
    hashes: list[bytes]
    tier: str = "local"  # "local": this worker's pool | "store": the cluster's KV store


class _Entry(NamedTuple):
    page: int
    token_ids: tuple[int, ...]


class PrefixCachePool:
    def __init__(self, allocator: PageAllocator, block_size: int,
                 on_event: Callable[[KVEvent], None] | None = None) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._on_event = on_event or (lambda ev: None)
        self.stats = {"lookups": 0, "hit_blocks": 0, "queried_blocks": 0, "stored_blocks": 0, "evicted_blocks": 0}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._entries

    def leading_cached(self, hashes: Sequence[bytes], max_blocks: int) -> int:
        """How many leading blocks of `hashes` (at most `max_blocks`) are cached now. Any thread: a
        hint that may be stale by the time it is used (no LRU touch, no stats, tokens not verified);
        `match` at admission is what counts."""
        n = 0
        for h in hashes[:max_blocks]:
            if h not in self._entries:
                break
            n += 1
        return n

    def report(self, event: KVEvent) -> None:
        """Pass an event of another tier to this pool's sink (any thread; the sink is a bounded deque)."""
        self._on_event(event)

    def match(self, hashes: Sequence[bytes], token_ids: Sequence[int], max_blocks: int) -> list[int]:
        """Pages of the longest verified cached prefix (at most `max_blocks`), each shared once more."""
        self.stats["lookups"] += 1
        self.stats["queried_blocks"] += min(len(hashes), max_blocks)
        pages: list[int] = []
        bs = self.block_size
        for i, h in enumerate(hashes[:max_blocks]):
            entry = self._entries.get(h)
            if entry is None or entry.token_ids != tuple(token_ids[i * bs:(i + 1) * bs]):
                break
            self._entries.move_to_end(h)
            pages.append(entry.page)
        if pages:
            self.allocator.share(pages)
            self.stats["hit_blocks"] += len(pages)
        return pages

    def insert_blocks(self, hashes: Sequence[bytes], block_token_ids: Sequence[Sequence[int]],
                      page_ids: Sequence[int]) -> None:
        """Cache blocks given one by one (hash, its token ids, its page); each page gains the cache's own
        reference. Blocks already cached are only touched."""
        stored = []
        for h, tokens, page in zip(hashes, block_token_ids, page_ids, strict=True):
            if h in self._entries:
                self._entries.move_to_end(h)
                continue
            self.allocator.share([page])
            self._entries[h] = _Entry(page, tuple(tokens))
            stored.append(h)
        if stored:
            self.stats["stored_blocks"] += len(stored)
            self._on_event(KVEvent("stored", stored))

    def evictable(self) -> int:
        """Blocks that only the cache references (what `evict` could free now)."""
        return sum(1 for e in self._entries.values() if self.allocator.refcount(e.page) == 1)

    def evict(self, num_pages: int, keep: Set[bytes] = frozenset()) -> int:
        """Free up to `num_pages` pages from least recently used unreferenced blocks (never those in
        `keep`); return how many."""
        victims = []
        for h, entry in self._entries.items():
            if len(victims) == num_pages:
                break
            if self.allocator.refcount(entry.page) == 1 and h not in keep:
                victims.append(h)
        if not victims:
            return 0
        pages = [self._entries.pop(h).page for h in victims]
        self.allocator.release(pages)
        self.stats["evicted_blocks"] += len(victims)
        self._on_event(KVEvent("removed", victims))
        return len(victims)

    def clear(self) -> None:
        """Drop every block (pages still shared by requests stay with them)."""
        if self._entries:
            hashes = list(self._entries)
            self.allocator.release([e.page for e in self._entries.values()])
            self._entries.clear()
            self._on_event(KVEvent("removed", hashes))
