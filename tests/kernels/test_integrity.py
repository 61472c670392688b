"""Batched KV page integrity check: the Triton kernel and its torch reference against a naive loop.

Batches are random: 1..64 requests whose page counts include 0 and 1 and span
several BLOCK-sized loop iterations, pages a random permutation of the pool (so
requests own pages out of order), tags random over the whole int32 range.
Mismatches are planted three ways: a wrong expected tag, a pool tag bumped (the
page was freed and reallocated), and a page id outside [0, num_pages). Outputs
must match exactly: ok flags and first_bad indices.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: CPU runs interpret the kernels

from typing import NamedTuple

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("numpy")  # the interpreter is numpy-backed

from kernels.integrity import check_pages, check_pages_ref  # noqa: E402
from tests.kernels.test_kv_store import DEVICES, seed  # noqa: E402,F401  (seed is a fixture)

INT32_MIN, INT32_MAX = -2**31, 2**31 - 1


class Batch(NamedTuple):
    page_ids: torch.Tensor  # [N] int32
    expected: torch.Tensor  # [N] int32
    seq_offsets: torch.Tensor  # [R + 1] int32
    tags: torch.Tensor  # [num_pages] int32

    def to(self, device: str) -> Batch:
        return Batch(*(t.to(device) for t in self))


def random_batch(num_requests: int, max_pages: int = 40) -> Batch:
    """All-good batch: page counts from {0, 1, 1..max_pages}, disjoint pages in random order."""
    kind = torch.randint(3, (num_requests,))
    lengths = torch.where(kind == 0, 0, torch.where(kind == 1, 1, torch.randint(1, max_pages + 1, (num_requests,))))
    seq_offsets = torch.zeros(num_requests + 1, dtype=torch.int32)
    seq_offsets[1:] = lengths.cumsum(0)
    num_entries = int(seq_offsets[-1])
    num_pages = num_entries + int(torch.randint(1, 50, ()))  # some pages free
    tags = torch.randint(INT32_MIN, INT32_MAX, (num_pages,), dtype=torch.int32)
    page_ids = torch.randperm(num_pages)[:num_entries].int()
    return Batch(page_ids, tags[page_ids.long()].clone(), seq_offsets, tags)


def plant(batch: Batch, share: float = 0.4, out_of_range: bool = True) -> Batch:
    """Corrupt one to three entries of a random share (and at least one) of the non-empty requests, in place."""
    page_ids, expected, seq_offsets, tags = batch
    num_pages = tags.numel()
    non_empty = (seq_offsets[1:] > seq_offsets[:-1]).nonzero().flatten()
    chosen = non_empty[torch.rand(non_empty.numel()) < share].tolist()
    if non_empty.numel() and not chosen:
        chosen = [int(non_empty[torch.randint(non_empty.numel(), ())])]
    for r in chosen:
        start, end = int(seq_offsets[r]), int(seq_offsets[r + 1])
        for i in (start + torch.randperm(end - start)[:int(torch.randint(1, 4, ()))]).tolist():
            how = int(torch.randint(3 if out_of_range else 2, ()))
            if how == 0:  # the request expects another tag
                expected[i] ^= int(torch.randint(1, INT32_MAX, ()))
            elif how == 1:  # the page was freed and reallocated: its tag moved on
                p = int(page_ids[i])
                tags[p] = INT32_MIN if int(tags[p]) == INT32_MAX else int(tags[p]) + 1
            else:  # a corrupt page id, below or above the pool
                page_ids[i] = int(torch.randint(INT32_MIN, 0, ())) if r % 2 else \
                    int(torch.randint(num_pages, INT32_MAX, ()))
    return batch


def naive(batch: Batch) -> tuple[list[bool], list[int]]:
    """The definition, one entry at a time."""
    page_ids, expected, seq_offsets, tags = (t.cpu().tolist() for t in batch)
    ok, first_bad = [], []
    for r in range(len(seq_offsets) - 1):
        bad = [i for i in range(seq_offsets[r], seq_offsets[r + 1])
               if not 0 <= page_ids[i] < len(tags) or tags[page_ids[i]] != expected[i]]
        ok.append(not bad)
        first_bad.append(bad[0] if bad else -1)
    return ok, first_bad


def assert_outputs(got: tuple[torch.Tensor, torch.Tensor], want: tuple[list[bool], list[int]], seed: int) -> None:
    ok, first_bad = got
    assert ok.dtype == torch.bool and first_bad.dtype == torch.int32
    assert ok.cpu().tolist() == want[0], f"seed {seed}"
    assert first_bad.cpu().tolist() == want[1], f"seed {seed}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_requests", [1, 5, 64])
@pytest.mark.parametrize("block", [16, 128])
def test_kernel_finds_planted_mismatches(device: str, num_requests: int, block: int, seed: int) -> None:
    batch = plant(random_batch(num_requests))
    want = naive(batch)
    assert not all(want[0]) or int(batch.seq_offsets[-1]) == 0, f"seed {seed}: nothing planted"
    batch = batch.to(device)
    before = [t.clone() for t in batch]

    assert_outputs(check_pages(*batch, block=block), want, seed)
    assert_outputs(check_pages_ref(*batch), want, seed)
    assert all(torch.equal(a, b) for a, b in zip(batch, before)), "inputs must not change"


@pytest.mark.parametrize("device", DEVICES)
def test_all_good_batches_pass(device: str, seed: int) -> None:
    for num_requests in (1, 2, 17, 64):
        batch = random_batch(num_requests).to(device)
        for ok, first_bad in (check_pages(*batch, block=16), check_pages_ref(*batch)):
            assert bool(ok.all()), f"seed {seed}"
            assert bool((first_bad == -1).all()), f"seed {seed}"


@pytest.mark.parametrize("device", DEVICES)
def test_first_bad_is_the_first_across_blocks(device: str) -> None:
    # request 1 owns entries 3..37 (35 entries: blocks of 16 at 3, 19, 35); bad at 35, 20 and 19
    page_ids = torch.randperm(64)[:40].int()
    tags = torch.randint(INT32_MIN, INT32_MAX, (64,), dtype=torch.int32)
    expected = tags[page_ids.long()].clone()
    seq_offsets = torch.tensor([0, 3, 38, 38, 40], dtype=torch.int32)
    for i in (35, 20, 19, 39):
        expected[i] += 1
    batch = Batch(page_ids, expected, seq_offsets, tags).to(device)
    want = ([True, False, True, False], [-1, 19, -1, 39])
    assert_outputs(check_pages(*batch, block=16), want, 0)
    assert_outputs(check_pages_ref(*batch), want, 0)
    expected[19] -= 1  # now the last bad entry of the second block leads
    expected[20] -= 1
    want = ([True, False, True, False], [-1, 35, -1, 39])
    assert_outputs(check_pages(*batch._replace(expected=expected.to(device)), block=16), want, 0)


@pytest.mark.parametrize("device", DEVICES)
def test_out_of_range_page_ids_are_mismatches(device: str) -> None:
    num_pages = 8
    tags = torch.zeros(num_pages, dtype=torch.int32)  # a read past the pool would find 0 and "match"
    page_ids = torch.tensor([0, num_pages, -1, INT32_MAX, INT32_MIN, 2**29, 7], dtype=torch.int32)
    expected = torch.zeros_like(page_ids)
    seq_offsets = torch.arange(page_ids.numel() + 1, dtype=torch.int32)
    want = ([True, False, False, False, False, False, True], [-1, 1, 2, 3, 4, 5, -1])
    batch = Batch(page_ids, expected, seq_offsets, tags).to(device)
    assert_outputs(check_pages(*batch), want, 0)
    assert_outputs(check_pages_ref(*batch), want, 0)
    # an empty pool: every entry is out of range
    empty = Batch(page_ids, expected, seq_offsets, tags[:0]).to(device)
    want = ([False] * 7, list(range(7)))
    assert_outputs(check_pages(*empty), want, 0)
    assert_outputs(check_pages_ref(*empty), want, 0)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batches(device: str) -> None:
    tags = torch.arange(4, dtype=torch.int32)
    none = torch.zeros(0, dtype=torch.int32)
    for seq_offsets, r in ((torch.zeros(1, dtype=torch.int32), 0), (torch.zeros(4, dtype=torch.int32), 3)):
        batch = Batch(none, none, seq_offsets, tags).to(device)
        for ok, first_bad in (check_pages(*batch), check_pages_ref(*batch)):
            assert ok.shape == first_bad.shape == (r,)
            assert bool(ok.all()) and bool((first_bad == -1).all())


def test_reference_matches_naive_loop(seed: int) -> None:
    for trial in range(40):
        batch = plant(random_batch(int(torch.randint(1, 65, ())), max_pages=int(torch.randint(1, 80, ()))),
                      share=float(torch.rand(())), out_of_range=trial % 2 == 0)
        assert_outputs(check_pages_ref(*batch), naive(batch), seed)


def test_rejects_bad_arguments() -> None:
    batch = random_batch(4)
    with pytest.raises(ValueError, match="page_ids must be"):
        check_pages(batch.page_ids.long(), *batch[1:])
    with pytest.raises(ValueError, match="expected must match"):
        check_pages(batch.page_ids, torch.zeros(batch.page_ids.numel() + 1, dtype=torch.int32), *batch[2:])
    with pytest.raises(ValueError, match="tags must be"):
        check_pages_ref(*batch[:3], batch.tags.view(1, -1))
    with pytest.raises(ValueError, match="seq_offsets must be"):
        check_pages(*batch[:2], torch.zeros(2, 2, dtype=torch.int32)[:, 0], batch.tags)  # strided
    bad_offsets = batch.seq_offsets.clone()
    bad_offsets[-1] += 1
    with pytest.raises(ValueError, match="seq_offsets must rise"):
        check_pages_ref(*batch[:2], bad_offsets, batch.tags)
