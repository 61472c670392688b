"""Fault injection for the KV integrity tests and benchmarks. Off by default.

Nothing here is reachable from any API, CLI flag or environment variable: a
fault exists only when in-process code calls one of these functions on an
engine. Each simulates a real class of page-reuse bug:

(a) `free_and_reallocate`: one of a running request's pages is released while
    still in use (a double release elsewhere) and handed to a new owner, which
    writes its own K/V there.
(b) `stale_page_table`: a request was preempted (its pages released and reused)
    and resumed with its old page table instead of a fresh one.
(c) KV transfer landing in a reallocated page: needs disaggregation (a later
    issue); until then (a) and (b).
"""

from __future__ import annotations

from backend.engine import LLMEngine
from backend.sequence import Sequence

__all__ = ["free_and_reallocate", "stale_page_table"]


def _take_specific(engine: LLMEngine, page: int) -> None:
    """Hand a free page to a new (anonymous) owner, as the allocator would."""
    alloc = engine.allocator
    free = alloc._free  # test-only reach into the allocator: the fault needs this exact page
    free.remove(page)
    free.appendleft(page)
    assert alloc.allocate(1) == [page]


def free_and_reallocate(engine: LLMEngine, victim: Sequence, page_index: int = 0,
                        new_owner_writes: bool = True) -> int:
    """Fault (a): release the victim's page `page_index` under it and give it to someone else.

    Returns the page id. With `new_owner_writes`, the new owner's K/V overwrite the
    page (random values), so a victim that read it would attend over foreign context."""
    page = victim.page_ids[page_index]
    engine.allocator.release([page])
    _take_specific(engine, page)
    if new_owner_writes:
        import torch

        g = engine.cache.geometry
        slots = torch.arange(page * g.page_size, (page + 1) * g.page_size)
        for layer in range(g.num_layers):
            k = torch.randn(g.page_size, g.num_kv_heads, g.head_dim, dtype=engine.model.dtype)
            engine.cache.store(layer, slots, k, torch.randn_like(k))
    return page


def stale_page_table(engine: LLMEngine, victim: Sequence) -> list[int]:
    """Fault (b): the victim is preempted (pages released, then reused) and resumes on its old table."""
    pages = list(victim.page_ids)
    engine.allocator.release(pages)
    for page in pages:
        _take_specific(engine, page)
    return pages
