"""Page allocator: a free list of physical KV pages with reference counts and generation tags.

A page is owned by every sequence (or cache entry) holding a reference; it goes
back on the free list when the last reference is dropped. The allocator never
over-commits: `allocate` either returns all the pages asked for or raises.

Generation tags: every page has an int32 tag that changes whenever the page
changes hands, i.e. when it is allocated and when its last reference is
dropped (sharing a live page keeps it). An owner records the tags it was given;
if a page it still uses was freed or handed to someone else meanwhile, the tags
no longer match and the batched integrity check (`kernels/integrity.py`) catches
it before the owner's next step. `tags` is the tensor that check reads; it lives on the device
the check runs on (the KV cache's: on a GPU the Triton check reads it there, with no copy per
step), and a Python list mirrors it for reads on the host (`tags_of`, `all_current`).
A decode worker reserves pages for incoming KV transfers from the event-loop
thread while the engine thread allocates and releases, so every method that
changes state takes one lock (uncontended in a unified worker: ~50 ns).
"""

from __future__ import annotations

import threading
from array import array
from collections import deque

import torch

from backend.errors import CapacityError

__all__ = ["PageAllocator"]


class PageAllocator:
    """Hands out page ids 0..num_pages-1."""

    def __init__(self, num_pages: int, device: torch.device | str = "cpu") -> None:
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._refs = [0] * num_pages
        self.tags = torch.zeros(num_pages, dtype=torch.int32, device=device)  # read by the integrity check
        self._tags = [0] * num_pages  # the same values, for cheap Python reads
        self._lock = threading.Lock()

    def _bump(self, pages: list[int]) -> None:
        """New generation for pages that change hands (one tensor write for all of them)."""
        if not pages:
            return
        new = [(self._tags[p] + 1) & 0x7FFFFFFF for p in pages]
        for p, tag in zip(pages, new):
            self._tags[p] = tag
        device = self.tags.device
        self.tags[torch.tensor(pages).to(device)] = torch.tensor(new, dtype=torch.int32).to(device)

    def tags_of(self, pages: list[int]) -> list[int]:
        """Current generation tags of pages (what an owner records); -1 for an id outside the pool."""
        n = self.num_pages
        return [self._tags[p] if 0 <= p < n else -1 for p in pages]

    def all_current(self, pages: array, tags: array) -> bool:
        """Whether every page id (array('i')) is in the pool and still carries its tag in `tags`
        (array('i')): the integrity check's usual answer, read from the Python mirror in C loops, with
        no tensor op (inside a step, ~15 small torch ops cost 180-300 us; this, 60-90 us with building its
        inputs, for 8-16 requests)."""
        if not pages:
            return True
        if min(pages) < 0 or max(pages) >= self.num_pages:
            return False
        return array("i", map(self._tags.__getitem__, pages)) == tags

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take n free pages (refcount 1 each) or raise CapacityError, taking none."""
        pages = self.try_allocate(n)
        if pages is None:
            free = len(self._free)
            raise CapacityError(f"need {n} KV pages, {free} free", needed=n, free=free)
        return pages

    def try_allocate(self, n: int) -> list[int] | None:
        """Take n free pages (refcount 1 each), or None, taking none: the check and the take are one step
        under the lock, so a caller racing another thread never sees a check pass and the take fail."""
        with self._lock:
            if n > len(self._free):
                return None
            pages = [self._free.popleft() for _ in range(n)]
            for p in pages:
                self._refs[p] = 1
            self._bump(pages)
            return pages

    def share(self, pages: list[int]) -> None:
        """Add a reference to pages already in use (prefix sharing)."""
        with self._lock:
            if any(self._refs[p] <= 0 for p in pages):
                raise ValueError(f"a page of {pages} is free; cannot share it")
            for p in pages:
                self._refs[p] += 1

    def release(self, pages: list[int]) -> None:
        """Drop one reference from each page; pages reaching zero become free."""
        freed = []
        with self._lock:
            for p in pages:
                if self._refs[p] <= 0:
                    raise ValueError(f"page {p} released while free (double free)")
                self._refs[p] -= 1
                if self._refs[p] == 0:
                    freed.append(p)
            self._bump(freed)
            self._free.extend(freed)

    def refcount(self, page: int) -> int:
        return self._refs[page]
