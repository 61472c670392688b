"""PageAllocator.all_current: the integrity check's fast answer agrees with the tag tensor the full check reads."""

from __future__ import annotations

from array import array

import torch

from backend.page_allocator import PageAllocator
from kernels.integrity import check_pages_ref


def _full_check(alloc: PageAllocator, pages: list[int], tags: list[int]) -> bool:
    ok, _ = check_pages_ref(torch.tensor(pages, dtype=torch.int32), torch.tensor(tags, dtype=torch.int32),
                            torch.tensor([0, len(pages)], dtype=torch.int32), alloc.tags)
    return bool(ok.all())


def test_current_pages_pass_and_pages_that_changed_hands_fail() -> None:
    alloc = PageAllocator(16)
    mine = alloc.allocate(5)
    tags = alloc.tags_of(mine)
    assert alloc.all_current(array("i", mine), array("i", tags)) and _full_check(alloc, mine, tags)
    alloc.release(mine[2:3])  # freed and handed to someone else: a new generation
    alloc.allocate(12)
    assert not alloc.all_current(array("i", mine), array("i", tags)) and not _full_check(alloc, mine, tags)
    assert alloc.all_current(array("i", mine[:2]), array("i", tags[:2]))  # the untouched ones still pass


def test_ids_outside_the_pool_fail_and_nothing_passes() -> None:
    alloc = PageAllocator(8)
    pages = alloc.allocate(3)
    tags = alloc.tags_of(pages)
    for bad in (-1, 8, 1000):
        assert not alloc.all_current(array("i", [*pages, bad]), array("i", [*tags, 1]))
    assert alloc.all_current(array("i"), array("i"))
