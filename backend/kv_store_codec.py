"""One full prompt block of a KV pool as one self-checking store object, and back.

A block is one KV page (`page_size` tokens) of every layer. Its object in the
cluster-wide store (`kv_store_tier.py`) is

    MAGIC (6 B, b"ESKV1\\0") | header length (u32 LE) | header (msgpack) | payload | crc32 (u32 LE)

- header: the store namespace, the block's chained hash (the key's own), the pool
  format, page size, layer count, the regions (name, parts, bytes per token) and
  the block's token ids;
- payload: the page's raw bytes for every region of the pool, in the pool's own
  format, region after region, each as ``[num_layers, (parts,) page_size, ...]``
  (the pool tensor with its page axis taken out). `PagedKVCache` has ``values``
  [L, 2, S, H, D] and, for FP8, ``scales`` [L, 2, S, H] (int8 exponents);
  `LatentKVCache` has ``latent`` [L, S, row] and, with a DSA indexer, ``index``
  [L, S, row bytes] (see `backend/kv_regions.py`). Nothing is converted: a block
  moves byte for byte between pools of the same format and geometry, which is
  also what the namespace (part of the key) pins;
- crc32 (zlib) of everything before it. It catches a torn or corrupted object,
  not a forged one: who may write the store is who may run a worker. A CRC runs
  at ~2 GB/s here against ~0.35 GB/s for BLAKE2b, and a 1k-token SmolLM2 prefix
  in fp32 pages is 47 MB, so the choice is 24 ms against 130 ms per fetch.

`decode_block` checks, in order, the magic and lengths, the checksum, the header
(namespace, hash, format, geometry) and the token ids against what the reader
expects; any mismatch raises `BlockRejected` with the reason ("malformed",
"checksum", "header", "tokens"), and the block is recomputed instead.
"""

from __future__ import annotations

import struct
import warnings
import zlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import msgspec
import numpy as np
import torch

from backend.kv_regions import pool_layout, pool_tensors
from backend.row_copies import index_copy_rows

__all__ = ["MAGIC", "RegionShape", "BlockLayout", "BlockRejected", "block_layout", "read_pages", "write_pages",
           "encode_block", "decode_block"]

MAGIC = b"ESKV1\0"
_LEN = struct.Struct("<I")


class RegionShape(NamedTuple):
    """One pool tensor as a block sees it."""

    name: str
    parts: int  # K and V (2) or one
    token_bytes: int  # bytes of one token of one (layer, part)


class BlockLayout(NamedTuple):
    """What a block object of one pool holds (equal layouts: blocks move byte for byte)."""

    kv_format: str
    page_size: int
    num_layers: int
    regions: tuple[RegionShape, ...]

    def region_bytes(self, r: RegionShape) -> int:
        return self.num_layers * r.parts * self.page_size * r.token_bytes

    @property
    def block_bytes(self) -> int:
        """Payload bytes of one block (all regions)."""
        return sum(self.region_bytes(r) for r in self.regions)


class _Header(msgspec.Struct, array_like=True, frozen=True):
    namespace: str
    block_hash: bytes
    kv_format: str
    page_size: int
    num_layers: int
    regions: list[tuple[str, int, int]]
    token_ids: list[int]


_encode_header = msgspec.msgpack.Encoder().encode
_decode_header = msgspec.msgpack.Decoder(_Header).decode


class BlockRejected(Exception):
    """A stored block failed verification; `reason` is "malformed", "checksum", "header" or "tokens"."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def block_layout(cache: Any) -> BlockLayout:
    """The block layout of a `PagedKVCache` or `LatentKVCache`."""
    lay = pool_layout(cache)
    return BlockLayout(lay.kv_format, lay.page_size, lay.num_layers,
                       tuple(RegionShape(r.name, r.parts, r.token_bytes) for r in lay.regions))


def _byte_tensors(cache: Any) -> list[tuple[torch.Tensor, int]]:
    """Each pool tensor as bytes (uint8, last axis widened by the element size) and its page axis."""
    lay = pool_layout(cache)
    out = []
    for t, region in zip(pool_tensors(cache), lay.regions):
        out.append((t if t.dtype == torch.uint8 else t.view(torch.uint8), 2 if region.parts > 1 else 1))
    return out


def read_pages(cache: Any, pages: Sequence[int]) -> torch.Tensor:
    """The payloads of `pages`, [len(pages), block_bytes] uint8 on the CPU (a copy; never writes).

    Any thread: the caller checks the pages' generation tags before and after (a page that
    changed hands meanwhile may hold another request's bytes)."""
    pieces = []
    for u8, axis in _byte_tensors(cache):
        idx = torch.tensor(list(pages), dtype=torch.int64, device=u8.device)
        sel = u8.index_select(axis, idx).movedim(axis, 0)  # [n, L, (2,) S, ...]
        pieces.append(sel.reshape(len(pages), -1).cpu())
    return torch.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0].contiguous()


def write_pages(cache: Any, pages: Sequence[int], payloads: Sequence[memoryview | bytes]) -> None:
    """Install block payloads (from `decode_block`) into `pages`, byte for byte. Engine thread, into
    pages the caller owns and nobody reads yet."""
    layout = block_layout(cache)
    n = len(pages)
    rows = torch.empty((n, layout.block_bytes), dtype=torch.uint8)  # [n, block_bytes]
    rows_np = rows.numpy()
    for i, p in enumerate(payloads):
        rows_np[i] = np.frombuffer(p, dtype=np.uint8)
    offset = 0
    for (u8, axis), region in zip(_byte_tensors(cache), layout.regions):
        nbytes = layout.region_bytes(region)
        shape = list(u8.shape)
        del shape[axis]
        src = rows[:, offset:offset + nbytes].reshape([n, *shape]).to(u8.device).movedim(0, axis)
        index_copy_rows(u8, axis, torch.tensor(list(pages), dtype=torch.int64, device=u8.device), src)
        offset += nbytes


def encode_block(namespace: str, block_hash: bytes, token_ids: Sequence[int], layout: BlockLayout,
                 payload: torch.Tensor | bytes) -> bytes:
    """The store object of one block (`payload`: its `read_pages` row)."""
    data = payload.numpy().tobytes() if isinstance(payload, torch.Tensor) else bytes(payload)
    if len(data) != layout.block_bytes:
        raise ValueError(f"a block payload is {layout.block_bytes} bytes, got {len(data)}")
    header = _encode_header(_Header(namespace, block_hash, layout.kv_format, layout.page_size, layout.num_layers,
                                    [tuple(r) for r in layout.regions], list(token_ids)))
    head = MAGIC + _LEN.pack(len(header)) + header
    crc = zlib.crc32(data, zlib.crc32(head))
    return b"".join((head, data, _LEN.pack(crc)))


def decode_block(data: bytes, namespace: str, block_hash: bytes, token_ids: Sequence[int],
                 layout: BlockLayout) -> memoryview:
    """The verified payload of a store object (a view into `data`), or `BlockRejected`."""
    view = memoryview(data)
    head_end = len(MAGIC) + _LEN.size
    if len(view) < head_end + _LEN.size or bytes(view[:len(MAGIC)]) != MAGIC:
        raise BlockRejected("malformed", f"not a KV block object ({len(view)} bytes)")
    (header_len,) = _LEN.unpack_from(view, len(MAGIC))
    payload_start = head_end + header_len
    if len(view) != payload_start + layout.block_bytes + _LEN.size:
        raise BlockRejected("malformed", f"a block object of this pool is {payload_start + layout.block_bytes + 4} "
                                         f"bytes, got {len(view)}")
    (crc,) = _LEN.unpack_from(view, len(view) - _LEN.size)
    if zlib.crc32(view[:-_LEN.size]) != crc:
        raise BlockRejected("checksum", "the block object's checksum does not match its bytes")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            header = _decode_header(view[head_end:payload_start])
    except msgspec.DecodeError as exc:
        raise BlockRejected("malformed", f"unreadable block header: {exc}") from exc
    expected = (namespace, block_hash, layout.kv_format, layout.page_size, layout.num_layers,
                [tuple(r) for r in layout.regions])
    found = (header.namespace, header.block_hash, header.kv_format, header.page_size, header.num_layers,
             [tuple(r) for r in header.regions])
    if found != expected:
        raise BlockRejected("header", f"the block object describes {found[2:]} under {found[0]!r}, "
                                      f"this pool expects {expected[2:]} under {expected[0]!r}")
    if header.token_ids != list(token_ids):
        raise BlockRejected("tokens", "the block object's token ids differ from the prompt's")
    return view[payload_start:payload_start + layout.block_bytes]
