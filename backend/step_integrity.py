"""The KV page-integrity check a step runs before its model call: which of the batch's sequences would read a
page that is no longer theirs.

Every page carries a tag that changes each time the page changes hands (`PageAllocator`); a sequence keeps the
tags its pages had when it got them. Before a step's model call the engine checks, in one batched pass over the
whole batch, that each sequence's pages still carry its tags, and ends a sequence that fails with
`KVIntegrityError` before anything is read from a page that is not its own. The causes, in `err.details["cause"]`:
- ``tag_mismatch``: a page carries another tag (it was freed and handed to another request);
- ``invalid_page``: a page id the pool does not have;
- ``overwritten``: the tags agree, but a direct KV transfer from a peer (`mooncake_transfer.py`) wrote into the
  page after it had changed hands: its new owner's KV is gone. `LLMEngine.check_transfer_target` records such pages
  (`mark_overwritten`) under the tag they then had; the entry holds until the page changes hands again.

On a GPU the Triton kernel (`kernels.integrity.check_pages`) reads the tags where they live, every step. On the
CPU the usual all-current answer comes from the allocator's tag mirror without a tensor op, and only when it
fails does the tensor check (`check_pages_ref`) find who failed.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from typing import NamedTuple

import torch

from backend.errors import KVIntegrityError
from backend.page_allocator import PageAllocator
from backend.sequence import Sequence

__all__ = ["IntegrityFailure", "StepIntegrity"]


class IntegrityFailure(NamedTuple):
    seq: Sequence
    error: KVIntegrityError  # details: page, expected_tag, found_tag, cause (tag_mismatch | invalid_page | overwritten)


def _int32(values: array) -> torch.Tensor:
    """An int32 tensor over an array('i') without copying it (torch.tensor of a list of ints took
    ~100 us per 1,000 entries, most of the integrity check's cost)."""
    return torch.frombuffer(values, dtype=torch.int32) if len(values) else torch.empty(0, dtype=torch.int32)


class StepIntegrity:
    """The check over one engine's page pool; the pages direct transfers overwrote."""

    def __init__(self, allocator: PageAllocator) -> None:
        self.allocator = allocator
        self.overwritten: dict[int, int] = {}  # page -> the tag it had when a direct KV transfer wrote into it

    def mark_overwritten(self, pages: Iterable[tuple[int, int]]) -> None:
        """(page, its current tag) pairs a peer's direct KV transfer has written into after they changed hands."""
        for page, tag in pages:
            self.overwritten[page] = tag

    def failures(self, seqs: list[Sequence]) -> list[IntegrityFailure]:
        """The sequences of `seqs` (a step's batch) that hold a page no longer theirs, each with the error that
        ends it (the first such page of each); empty when every page is its sequence's."""
        from kernels.integrity import check_pages, check_pages_ref

        page_ids, expected, offsets = array("i"), array("i"), array("i", [0])  # int32, read by torch in place
        for s in seqs:
            page_ids.extend(s.page_ids)
            expected.extend(s.page_tags)
            offsets.append(len(page_ids))
        tags = self.allocator.tags
        if not tags.is_cuda and not self.overwritten and self.allocator.all_current(page_ids, expected):
            return []  # every page still the request's: the usual step, no tensor op
        check = check_pages if tags.is_cuda else check_pages_ref
        ok, first_bad = check(*(_int32(a).to(tags.device) for a in (page_ids, expected, offsets)), tags)
        if self.overwritten:
            ok = ok & self._not_overwritten(seqs).to(ok.device)
        if bool(ok.all()):
            return []
        out = []
        for i in (~ok.bool()).nonzero().flatten().tolist():
            s = seqs[i]
            j = int(first_bad[i]) - offsets[i]
            if int(first_bad[i]) < 0:  # tags fine: a page was overwritten by a direct transfer
                j = next(k for k, p in enumerate(s.page_ids) if self.overwritten.get(p) == s.page_tags[k])
            page, want = s.page_ids[j], s.page_tags[j]
            found = self.allocator.tags_of([page])[0]
            cause = "overwritten" if found == want else "tag_mismatch" if found >= 0 else "invalid_page"
            what = ("was overwritten by a KV transfer meant for another request" if cause == "overwritten" else
                    f"expected tag {want}, found {found if found >= 0 else 'no such page'}")
            err = KVIntegrityError(
                f"KV integrity check failed for request {s.request_id}: page {page} {what}; aborted before reading it",
                request_id=s.request_id, page=page, expected_tag=want, found_tag=found, cause=cause)
            out.append(IntegrityFailure(s, err))
        return out

    def _not_overwritten(self, seqs: list[Sequence]) -> torch.Tensor:
        """Per sequence: True unless one of its pages, under its current tag, was overwritten by a direct
        KV transfer (entries of pages that changed hands again since are dropped)."""
        live = self.allocator.tags_of(list(self.overwritten))
        for (page, tag), now in zip(list(self.overwritten.items()), live):
            if now != tag:
                del self.overwritten[page]
        return torch.tensor([not any(self.overwritten.get(p) == t for p, t in zip(s.page_ids, s.page_tags))
                             for s in seqs], dtype=torch.bool)
