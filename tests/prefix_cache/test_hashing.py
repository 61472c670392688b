"""Chained, salted block hashes."""

from __future__ import annotations

import random

from prefix_cache.hashing import HASH_BYTES, block_hashes


def test_only_full_blocks_are_hashed_and_each_covers_its_whole_prefix() -> None:
    rng = random.Random(0)
    ids = [rng.randrange(50_000) for _ in range(70)]
    hs = block_hashes(ids, 16, "tenant-a")
    assert len(hs) == 4 and all(len(h) == HASH_BYTES for h in hs) and len(set(hs)) == 4
    assert block_hashes(ids[:64], 16, "tenant-a") == hs  # the partial tail changes nothing
    changed = list(ids)
    changed[3] += 1  # a token of block 0: every later hash changes (chaining)
    assert all(a != b for a, b in zip(block_hashes(changed, 16, "tenant-a"), hs))
    changed = list(ids)
    changed[40] += 1  # a token of block 2: blocks 0 and 1 keep their hashes
    again = block_hashes(changed, 16, "tenant-a")
    assert again[:2] == hs[:2] and again[2] != hs[2] and again[3] != hs[3]


def test_the_salt_separates_tenants_and_extra_keys_separate_variants() -> None:
    ids = list(range(48))
    assert not set(block_hashes(ids, 16, "tenant-a")) & set(block_hashes(ids, 16, "tenant-b"))
    assert block_hashes(ids, 16, "t") != block_hashes(ids, 16, "t", extra=b"adapter-1")
    assert block_hashes(ids, 16, "t") == block_hashes(ids, 16, b"t")
