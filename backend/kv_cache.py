"""Paged KV cache: storage formats behind one contract, sized from a byte budget.

Storage layout, per format, one tensor for the whole pool:
    pages: [num_layers, 2 (K, V), num_pages, PAGE_SIZE, num_kv_heads, head_dim]
A token's *slot* is ``page_id * PAGE_SIZE + offset``. A page is the unit of
allocation (see `page_allocator.py`); the cache itself knows nothing of owners.

Formats (chosen per worker):
- ``bf16``: pages stored in bfloat16, read back as the compute dtype.
- ``fp32``: pages stored in float32 (parity tests against float32 references).
FP8 (e4m3 with scales) plugs in as another `PagedKVCache` subclass.

Bytes per token = num_layers * 2 * num_kv_heads * head_dim * element size
(+ scale bytes for quantised formats); the pool holds
``kv_cache_bytes // (PAGE_SIZE * bytes_per_token)`` pages.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

import torch

from backend.config import ModelConfig
from backend.errors import InvalidRequest

__all__ = ["KV_FORMATS", "KVGeometry", "PagedKVCache", "DenseKVCache", "create_kv_cache"]


class KVGeometry(NamedTuple):
    """Shape of one worker's pool."""

    num_layers: int
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int


class PagedKVCache(ABC):
    """Contract of a KV page store.

    `store` writes the K/V of new tokens at their slots (mutates the pool only at
    those slots). `gather` returns, per sequence, the K/V of its pages in
    page-table order as the compute dtype; it reads, never writes.
    """

    format_name: str
    geometry: KVGeometry
    bytes_per_token: int  # pool bytes one token occupies over all layers, K and V, scales included

    @abstractmethod
    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v [T, num_kv_heads, head_dim] at slots [T] (int64) of `layer`."""

    @abstractmethod
    def gather(self, layer: int, page_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [B, P * PAGE_SIZE, num_kv_heads, head_dim] for page_table [B, P] (int64)."""

    @property
    def num_pages(self) -> int:
        return self.geometry.num_pages

    @property
    def page_size(self) -> int:
        return self.geometry.page_size

    @property
    def total_bytes(self) -> int:
        return self.num_pages * self.page_size * self.bytes_per_token


class DenseKVCache(PagedKVCache):
    """Unquantised pages (bf16 or fp32), read back as the compute dtype."""

    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, storage_dtype: torch.dtype,
                 compute_dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.format_name = {torch.bfloat16: "bf16", torch.float32: "fp32"}[storage_dtype]
        self.geometry = KVGeometry(cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        self.compute_dtype = compute_dtype
        self.bytes_per_token = self.bytes_per_token_for(cfg, storage_dtype)
        # [num_layers, 2, num_pages, PAGE_SIZE, num_kv_heads, head_dim]
        self.pages = torch.zeros(cfg.num_layers, 2, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim,
                                 dtype=storage_dtype, device=device)
        # views made once (indexing per call costs a dispatch): per layer and K/V,
        # one row per page (a gather copies whole contiguous pages) and one row per slot
        page_rows = self.pages.view(cfg.num_layers, 2, num_pages, -1)
        slot_rows = self.pages.view(cfg.num_layers, 2, num_pages * page_size, cfg.num_kv_heads, cfg.head_dim)
        self._page_rows = [(page_rows[i, 0], page_rows[i, 1]) for i in range(cfg.num_layers)]
        self._slot_rows = [(slot_rows[i, 0], slot_rows[i, 1]) for i in range(cfg.num_layers)]

    @staticmethod
    def bytes_per_token_for(cfg: ModelConfig, storage_dtype: torch.dtype) -> int:
        return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * storage_dtype.itemsize

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        k_rows, v_rows = self._slot_rows[layer]
        if k.dtype != k_rows.dtype:
            k, v = k.to(k_rows.dtype), v.to(k_rows.dtype)
        k_rows.index_copy_(0, slots, k)
        v_rows.index_copy_(0, slots, v)

    def gather(self, layer: int, page_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, p = page_table.shape
        g = self.geometry
        flat = page_table.reshape(-1)
        k_pages, v_pages = self._page_rows[layer]
        k, v = k_pages.index_select(0, flat), v_pages.index_select(0, flat)
        shape = (b, p * g.page_size, g.num_kv_heads, g.head_dim)
        k, v = k.view(shape), v.view(shape)
        if k.dtype != self.compute_dtype:
            k, v = k.to(self.compute_dtype), v.to(self.compute_dtype)
        return k, v


KV_FORMATS: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp32": torch.float32}


def create_kv_cache(cfg: ModelConfig, kv_format: str, kv_cache_bytes: int, page_size: int,
                    compute_dtype: torch.dtype, device: torch.device | str = "cpu") -> PagedKVCache:
    """The one place a KV format is chosen: size the pool from the byte budget and allocate it."""
    if kv_format not in KV_FORMATS:
        raise InvalidRequest(f"unknown kv format {kv_format!r}; supported: {', '.join(KV_FORMATS)}")
    storage = KV_FORMATS[kv_format]
    per_page = page_size * DenseKVCache.bytes_per_token_for(cfg, storage)
    num_pages = kv_cache_bytes // per_page
    if num_pages < 1:
        raise InvalidRequest(f"kv cache budget {kv_cache_bytes} B is below one page ({per_page} B)")
    return DenseKVCache(cfg, int(num_pages), page_size, storage, compute_dtype, device)
