"""Fault injection for the KV integrity tests and benchmarks. Off by default.

Nothing here is reachable from any API, CLI flag or environment variable: a
fault exists only when in-process code calls one of these functions on an
engine. Each simulates a real class of page-reuse bug:

(a) `free_and_reallocate`: one of a running request's pages is released while
    still in use (a double release elsewhere) and handed to a new owner, which
    writes its own K/V there.
(b) `stale_page_table`: a request was preempted (its pages released and reused)
    and resumed with its old page table instead of a fresh one.
(c) a KV transfer landing in a reallocated page: a decode worker's reserved page
    is reused while the prefill worker's KV is still arriving; apply (a) to the
    reserved sequence between two `install_kv` calls, which must refuse the write
    (KVIntegrityError, cause "transfer_target"; tests/backend/test_disagg.py).
(d) `free_held_and_reallocate`: a prefill worker's held pages are freed (as
    `_expire_held` does when the KV is not collected in time, or an abort) and
    handed to a new owner while the prefill server is still reading the KV out;
    `read_kv` must refuse (KVIntegrityError, cause "held_read") and the transfer
    end with a KVError frame instead of shipping the new owner's KV
    (tests/backend/test_engine_hardening.py).

(a) and (b) are caught by the batched check before the victim's next step
(tests/backend/test_integrity.py; on MLA latent pages, tests/backend/test_mla_serving.py).
"""

from __future__ import annotations

from backend.engine import LLMEngine
from backend.sequence import Sequence

__all__ = ["free_and_reallocate", "stale_page_table", "free_held_and_reallocate"]


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
        _write_random(engine, page)
    return page


def _write_random(engine: LLMEngine, page: int) -> None:
    """The new owner stores its own K/V (random values) in every layer of `page`."""
    import torch

    from backend.latent_kv_cache import LatentKVCache

    cache = engine.cache
    g = cache.geometry
    slots = torch.arange(page * g.page_size, (page + 1) * g.page_size)
    for layer in range(g.num_layers):
        if isinstance(cache, LatentKVCache):  # MLA: a latent row per token (and the DSA indexer's key)
            dev, dtype = cache.pages.device, engine.model.dtype
            cache.store(layer, slots.to(dev), torch.randn(g.page_size, cache.kv_lora_rank, dtype=dtype, device=dev),
                        torch.randn(g.page_size, cache.rope_dim, dtype=dtype, device=dev))
            if cache.indexer is not None:
                cache.indexer.store(layer, slots.to(dev), torch.randn(g.page_size, cache.indexer.head_dim, device=dev))
            continue
        k = torch.randn(g.page_size, g.num_kv_heads, g.head_dim, dtype=engine.model.dtype)
        cache.store(layer, slots, k, torch.randn_like(k))


def stale_page_table(engine: LLMEngine, victim: Sequence) -> list[int]:
    """Fault (b): the victim is preempted (pages released, then reused) and resumes on its old table."""
    pages = list(victim.page_ids)
    engine.allocator.release(pages)
    for page in pages:
        _take_specific(engine, page)
    return pages


def free_held_and_reallocate(engine: LLMEngine, victim: Sequence, new_owner_writes: bool = True) -> list[int]:
    """Fault (d): free a held request's pages under its KV reader and give them all to a new owner.

    Returns the page ids (now the new owner's). With `new_owner_writes`, the new owner's K/V
    overwrite them, so a reader that did not check would ship another request's context."""
    pages = list(victim.page_ids)
    if not engine.release_held(victim.request_id):
        raise ValueError(f"request {victim.request_id} holds no pages")
    for page in pages:
        _take_specific(engine, page)
        if new_owner_writes:
            _write_random(engine, page)
    return pages
