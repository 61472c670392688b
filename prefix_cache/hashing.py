"""Chained block hashes: the identity of a cached KV block, shared by gateway and workers.

A block is `block_size` consecutive tokens (a KV page). Its hash covers the whole
prefix up to and including it, by chaining:

    h_0 = H(salt_digest, ids of block 0, extra)
    h_i = H(h_{i-1},     ids of block i, extra)

H is BLAKE2b with a 16-byte digest over the int32 little-endian bytes of the
ids; `salt_digest` = BLAKE2b(salt). Only full blocks are hashed: a partial last
block can still grow and is never shared. Equal hashes mean equal prefixes
(up to a 2^-128 collision), but hits are still re-verified against the stored
token ids before a page is reused.

The salt separates tenants: the gateway sets it from the authenticated tenant,
never from anything the client sends, so two tenants with the same system
prompt get different hashes and can never share (or probe for) each other's
blocks. `extra` keys anything else the KV depends on (e.g. an adapter id).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

__all__ = ["block_hashes", "HASH_BYTES"]

HASH_BYTES = 16


def _h(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=HASH_BYTES)
    for part in parts:
        h.update(len(part).to_bytes(4, "little"))  # length-prefixed: part boundaries cannot shift
        h.update(part)
    return h.digest()


def block_hashes(token_ids: Sequence[int], block_size: int, salt: str | bytes = b"",
                 extra: bytes = b"") -> list[bytes]:
    """Hashes of every full block of `token_ids`, in order (len = len(token_ids) // block_size)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    salt_bytes = salt.encode() if isinstance(salt, str) else salt
    parent = _h(b"edgeserve-prefix-v1", salt_bytes)
    out: list[bytes] = []
    ids = array("i", token_ids)
    if ids.itemsize != 4:  # pragma: no cover - int is 4 bytes on every platform we run
        raise RuntimeError("array('i') is not 32-bit here")
    for start in range(0, len(ids) - block_size + 1, block_size):
        parent = _h(parent, ids[start:start + block_size].tobytes(), extra)
        out.append(parent)
    return out
