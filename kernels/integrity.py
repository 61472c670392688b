"""Batched KV page integrity check: do a batch's page tables still point at the pages they were given?

Every physical KV page carries a generation tag (int32) in the pool's tag table
``tags [num_pages]``, changed each time the page is allocated. A request records
the (page id, tag) pairs it expects. Before an engine step, one call checks the
whole batch, flattened CSR-style:

    page_ids    [N] int32   every request's page ids, request after request
    expected    [N] int32   the tag each entry expects
    seq_offsets [R + 1] int32  request r owns entries seq_offsets[r] .. seq_offsets[r+1] - 1
    tags        [num_pages] int32

and returns, per request,

    ok        [R] bool   True iff every one of its entries matches (a request with no pages is ok)
    first_bad [R] int32  index into the flattened arrays of its first mismatching entry, -1 if ok

An entry mismatches if ``tags[page_ids[i]] != expected[i]`` or its page id lies
outside [0, num_pages): a corrupt page table is reported, never read out of bounds
(the kernel masks that load; the reference gathers from a clamped id).

What it guarantees: a request passes only if, at the time of the check, each of
its pages is still the same allocation it was given; a page freed and handed to
another request, or a stale or corrupt table entry, fails it (up to tag reuse,
which the allocator's monotonically changing tags make a 2**32-allocation wrap).
It checks page identity, not page contents.

Cost: one int32 gather from the tag table plus one compare per page of the batch
(8 bytes read from the request side, 4 from the pool), and a per-request
reduction; it is a separate launch, independent of the attention kernel, so the
attention path is unchanged. At 64 requests of 8k-token contexts and 16-token
pages that is 32k entries, ~400 KB read: microseconds on a GPU. The CPU runtime
path, `check_pages_ref`, is the same work vectorised in torch (no Python loop
over requests). The engine on CPU asks the page allocator's Python mirror of the tags
first (`PageAllocator.all_current`: the usual step, where every page is still its
request's, without a tensor op) and calls `check_pages_ref` only when that finds a page
that changed hands, for the per-request answer.

`seq_offsets` must start at 0, be nondecreasing and end at N. The reference
checks this (on CPU, where it is cheap); the kernel does not synchronise to check
it but clamps each request's range into [0, N], so bad offsets give unspecified
flags, never an out-of-bounds read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["check_pages", "check_pages_ref", "DEFAULT_BLOCK"]

DEFAULT_BLOCK = 128  # entries per loop iteration: 8 pages is a 128-token request at page size 16
_NO_BAD = 2**31 - 1  # int32 max: "no mismatch yet" in the running minimum of bad indices


# ---------------------------------------------------------------- kernel

@triton.jit
def _check_pages_kernel(
    # pointers
    page_ids_ptr,  # [N] int32
    expected_ptr,  # [N] int32
    seq_offsets_ptr,  # [R + 1] int32
    tags_ptr,  # [num_pages] int32
    ok_ptr,  # [R] bool
    first_bad_ptr,  # [R] int32
    # sizes
    num_entries,  # N
    num_pages,
    # meta-parameters
    BLOCK: tl.constexpr,
):
    """One program per request: scan its entries BLOCK at a time, keep the smallest bad index."""
    pid = tl.program_id(0)
    start = tl.load(seq_offsets_ptr + pid)
    end = tl.load(seq_offsets_ptr + pid + 1)
    start = tl.minimum(tl.maximum(start, 0), num_entries)  # a corrupt offsets table stays in bounds
    end = tl.minimum(tl.maximum(end, start), num_entries)
    offs = tl.arange(0, BLOCK)
    first = tl.full([BLOCK], 2147483647, tl.int32)  # _NO_BAD, per lane
    for block_start in range(start, end, BLOCK):
        offs_e = block_start + offs
        mask_e = offs_e < end
        page = tl.load(page_ids_ptr + offs_e, mask=mask_e, other=0).to(tl.int64)
        want = tl.load(expected_ptr + offs_e, mask=mask_e, other=0)
        in_range = (page >= 0) & (page < num_pages)
        got = tl.load(tags_ptr + page, mask=mask_e & in_range, other=0)
        bad = mask_e & ((got != want) | ~in_range)
        first = tl.minimum(first, tl.where(bad, offs_e, 2147483647))
    first_bad = tl.min(first, axis=0)
    is_ok = first_bad == 2147483647
    tl.store(ok_ptr + pid, is_ok)
    tl.store(first_bad_ptr + pid, tl.where(is_ok, -1, first_bad))


# ---------------------------------------------------------------- launcher

def _check_args(page_ids: torch.Tensor, expected: torch.Tensor, seq_offsets: torch.Tensor,
                tags: torch.Tensor) -> None:
    named = {"page_ids": page_ids, "expected": expected, "seq_offsets": seq_offsets, "tags": tags}
    for name, t in named.items():
        if t.dim() != 1 or t.dtype != torch.int32 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous 1-D int32 tensor, got {tuple(t.shape)} {t.dtype}")
    if expected.shape != page_ids.shape:
        raise ValueError(f"expected must match page_ids [{page_ids.numel()}], got {tuple(expected.shape)}")
    if seq_offsets.numel() < 1:
        raise ValueError("seq_offsets must hold R + 1 >= 1 offsets")
    if len({t.device for t in named.values()}) != 1:
        raise ValueError("page_ids, expected, seq_offsets and tags must be on one device")
    if page_ids.numel() >= _NO_BAD:
        raise ValueError(f"at most {_NO_BAD - 1} entries (int32 indices), got {page_ids.numel()}")


def check_pages(page_ids: torch.Tensor, expected: torch.Tensor, seq_offsets: torch.Tensor, tags: torch.Tensor,
                *, block: int = DEFAULT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(ok [R] bool, first_bad [R] int32) for a flattened batch of page tables (Triton); see the module doc."""
    _check_args(page_ids, expected, seq_offsets, tags)
    num_requests = seq_offsets.numel() - 1
    ok = torch.empty(num_requests, dtype=torch.bool, device=page_ids.device)  # [R]
    first_bad = torch.empty(num_requests, dtype=torch.int32, device=page_ids.device)  # [R]
    if num_requests == 0:
        return ok, first_bad
    _check_pages_kernel[(num_requests,)](
        page_ids, expected, seq_offsets, tags, ok, first_bad,
        page_ids.numel(), tags.numel(),
        BLOCK=block,
    )
    return ok, first_bad


# ---------------------------------------------------------------- torch reference

def check_pages_ref(page_ids: torch.Tensor, expected: torch.Tensor, seq_offsets: torch.Tensor,
                    tags: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch `check_pages` (the CPU runtime's path): same arguments, same outputs, vectorised."""
    _check_args(page_ids, expected, seq_offsets, tags)
    num_entries, num_pages = page_ids.numel(), tags.numel()
    num_requests = seq_offsets.numel() - 1
    lengths = seq_offsets.diff()  # [R]
    if int(seq_offsets[0]) != 0 or int(seq_offsets[-1]) != num_entries or bool((lengths < 0).any()):
        raise ValueError(f"seq_offsets must rise from 0 to {num_entries}, got {seq_offsets.tolist()[:8]}...")
    in_range = (page_ids >= 0) & (page_ids < num_pages)  # [N]
    if num_pages:
        got = tags[page_ids.long().clamp(0, num_pages - 1)]
        bad = (got != expected) | ~in_range
    else:
        bad = torch.ones_like(in_range)
    owner = torch.repeat_interleave(torch.arange(num_requests, device=page_ids.device), lengths.long(),
                                    output_size=num_entries)  # [N] request of each entry
    index = torch.arange(num_entries, dtype=torch.int32, device=page_ids.device)
    first = torch.full((num_requests,), _NO_BAD, dtype=torch.int32, device=page_ids.device)
    first.scatter_reduce_(0, owner, torch.where(bad, index, _NO_BAD), reduce="amin")
    ok = first == _NO_BAD
    return ok, torch.where(ok, -1, first)
