"""Paged KV cache: storage formats behind one contract, sized from a byte budget.

Storage layout, one tensor for the whole pool:
    pages: [num_layers, 2 (K, V), num_pages, PAGE_SIZE, num_kv_heads, head_dim]
A token's *slot* is ``page_id * PAGE_SIZE + offset``. A page is the unit of
allocation (see `page_allocator.py`); the cache itself knows nothing of owners.
K is stored in the interleaved-pair RoPE layout (see `rope.py`).

Formats (chosen per worker, in `create_kv_cache` only):
- ``fp32`` / ``bf16``: values stored as is, read back as the compute dtype.
- ``fp8_e4m3``: values as `torch.float8_e4m3fn` (max 448) plus one scale per
  (token, KV head), stored beside the pages as an int8 power-of-two exponent e
  (an E8M0-style scale; value = fp8 * 2**e):
      scales: [num_layers, 2, num_pages, PAGE_SIZE, num_kv_heads] int8
  computed on write from the token's own values (no calibration):
      e = clamp(ceil(log2(amax / 448)), -64, 63), amax = max |x| over head_dim,
      stored = clamp(x * 2**-e, -448, 448) rounded to e4m3.
  Per token-and-head rather than per page-and-head, so a page's earlier tokens
  never need re-quantising when a later token is larger. Power-of-two, because
  e4m3 is itself floating point: the scale only has to keep values in range, so
  a one-byte exponent loses no relative precision and keeps the overhead at 1 B
  per 64 values. The quantise/dequantise code lives in `kernels/kv_store.py`
  (Triton kernel on CUDA, its torch reference on CPU); on the CPU a store, FP8 or
  plain, runs `kernels/cpu_kv_store.py`'s C kernels (the same bytes in one call)
  where they build.

Bytes per token = num_layers * 2 * num_kv_heads * (head_dim * element size
+ scale bytes); the pool holds ``kv_cache_bytes // (PAGE_SIZE * bytes_per_token)``
pages. For SmolLM2 (30 layers, 3 KV heads, head_dim 64): bf16 23,040 B, fp8
11,700 B per token, a capacity ratio of 1.969.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from backend.config import ModelConfig
from backend.errors import InvalidRequest
from backend.row_copies import index_copy_rows
from kernels.cpu_kv_store import store_kv_fp8_cpu, store_kv_rows_cpu
from kernels.kv_store import dequantize_fp8_ref, dequantize_fp8_table, store_kv, store_kv_ref

if TYPE_CHECKING:
    from backend.latent_kv_cache import LatentKVCache

__all__ = ["KV_FORMATS", "KVGeometry", "LayerKV", "PagedKVCache", "create_kv_cache", "kv_bytes_per_token",
           "pages_for_budget"]

# format name -> (storage dtype, scale bytes per (token, head))
KV_FORMATS: dict[str, tuple[torch.dtype, int]] = {
    "fp32": (torch.float32, 0),
    "bf16": (torch.bfloat16, 0),
    "fp8_e4m3": (torch.float8_e4m3fn, 1),
}


class KVGeometry(NamedTuple):
    """Shape of one worker's pool."""

    num_layers: int
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int


class LayerKV(NamedTuple):
    """One layer's pages as the kernels take them (K/V: [num_pages, PAGE_SIZE, kv_heads, head_dim])."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None  # [num_pages, PAGE_SIZE, kv_heads] int8 exponents (fp8 only)
    v_scale: torch.Tensor | None


def kv_bytes_per_token(cfg: ModelConfig, kv_format: str) -> int:
    """Pool bytes one token occupies over all layers, K and V, scales included (an MLA model's
    latent rows: `backend/latent_kv_cache.py`)."""
    if cfg.is_mla:
        from backend.latent_kv_cache import latent_kv_bytes_per_token

        return latent_kv_bytes_per_token(cfg, kv_format)
    dtype, scale_bytes = KV_FORMATS[kv_format]
    return cfg.num_layers * 2 * cfg.num_kv_heads * (cfg.head_dim * dtype.itemsize + scale_bytes)


class PagedKVCache:
    """The KV page store of one worker.

    `store` writes the K/V of new tokens at their slots (mutates the pool only at
    those slots and their scales). `gather` returns, per sequence, the K/V of its
    pages in page-table order, dequantised to the compute dtype; it never writes.
    `layer(i)` hands the raw pages to the Triton kernels.
    """

    def __init__(self, cfg: ModelConfig, kv_format: str, num_pages: int, page_size: int,
                 compute_dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.format_name = kv_format
        dtype, scale_bytes = KV_FORMATS[kv_format]
        self.quantised = scale_bytes > 0
        self.geometry = KVGeometry(cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        self.compute_dtype = compute_dtype
        self.bytes_per_token = kv_bytes_per_token(cfg, kv_format)
        # [num_layers, 2, num_pages, PAGE_SIZE, num_kv_heads, head_dim]
        self.pages = torch.zeros(cfg.num_layers, 2, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim,
                                 dtype=dtype, device=device)
        # [num_layers, 2, num_pages, PAGE_SIZE, num_kv_heads]
        self.scales = (torch.full((cfg.num_layers, 2, num_pages, page_size, cfg.num_kv_heads), -64,
                                  dtype=torch.int8, device=device) if self.quantised else None)
        self._layers = [LayerKV(self.pages[i, 0], self.pages[i, 1],
                                self.scales[i, 0] if self.scales is not None else None,
                                self.scales[i, 1] if self.scales is not None else None)
                        for i in range(cfg.num_layers)]
        # raw byte rows for gathers: one row per page (a gather copies whole contiguous pages)
        raw = self.pages.view(torch.uint8) if self.quantised else self.pages
        page_rows = raw.view(cfg.num_layers, 2, num_pages, -1)
        self._page_rows = [(page_rows[i, 0], page_rows[i, 1]) for i in range(cfg.num_layers)]
        if self.scales is not None:
            scale_rows = self.scales.view(cfg.num_layers, 2, num_pages, -1)
            self._scale_rows = [(scale_rows[i, 0], scale_rows[i, 1]) for i in range(cfg.num_layers)]

    @property
    def num_pages(self) -> int:
        return self.geometry.num_pages

    @property
    def page_size(self) -> int:
        return self.geometry.page_size

    @property
    def total_bytes(self) -> int:
        return self.num_pages * self.page_size * self.bytes_per_token

    def layer(self, i: int) -> LayerKV:
        return self._layers[i]

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v [T, num_kv_heads, head_dim] at slots [T] (int64) of `layer`."""
        kv = self._layers[layer]
        if kv.k.is_cuda:  # the pool's device decides (rows from elsewhere are moved to it)
            dev = kv.k.device
            store_kv(k.to(dev), v.to(dev), kv.k, kv.v, kv.k_scale, kv.v_scale, slots.to(dev))
        elif not (store_kv_rows_cpu(k, v, kv.k, kv.v, slots) if kv.k_scale is None else
                  store_kv_fp8_cpu(k, v, kv.k, kv.v, kv.k_scale, kv.v_scale, slots)):
            store_kv_ref(k, v, kv.k, kv.v, kv.k_scale, kv.v_scale, slots)  # without the C kernels, other layouts

    def write_tokens(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
        """Install transferred K/V [T, kv_heads, head_dim] at slots [T]: FP8 values with their int8
        exponents [T, kv_heads] are copied byte for byte into an FP8 pool; anything else goes
        through `store` (quantised on the way in if the pool is FP8)."""
        if k_scale is not None and self.quantised and k.dtype == torch.float8_e4m3fn:
            kv = self._layers[layer]
            g = self.geometry
            pages, offsets = slots // g.page_size, slots % g.page_size
            for x, e, cache, scale in ((k, k_scale, kv.k, kv.k_scale), (v, v_scale, kv.v, kv.v_scale)):
                cache.view(torch.uint8)[pages, offsets] = x.view(torch.uint8).to(cache.device)
                scale[pages, offsets] = e.to(scale.device)
            return
        if k_scale is not None:  # FP8 on the wire into a plain pool: dequantise first
            k, v = dequantize_fp8_ref(k, k_scale), dequantize_fp8_ref(v, v_scale)
        self.store(layer, slots, k.to(self.compute_dtype), v.to(self.compute_dtype))

    def write_stored(self, layer: int, page_ids: list[int], k: torch.Tensor, v: torch.Tensor, k_exp: torch.Tensor,
                     v_exp: torch.Tensor) -> None:
        """`write_tokens` of FP8 K, V [T, kv_heads, head_dim] and their int8 exponents [T, kv_heads] at positions
        0..T-1 under `page_ids` (a prompt's pages, in order), byte for byte into an FP8 pool: whole pages as
        rows (`read_stored`'s inverse; `row_copies.py`: ~3x faster than by slot), a last partial page as a slice of
        its row."""
        if not self.quantised:
            raise ValueError(f"a {self.format_name} pool stores no FP8 pages")
        g = self.geometry
        t = k.shape[0]
        full = t // g.page_size
        dev = self.pages.device
        idx = torch.tensor(page_ids[:full], dtype=torch.int64, device=dev)
        for x, rows in ((k, self._page_rows[layer][0]), (v, self._page_rows[layer][1]),
                        (k_exp, self._scale_rows[layer][0]), (v_exp, self._scale_rows[layer][1])):
            x = x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x
            if full:
                index_copy_rows(rows, 0, idx, x[:full * g.page_size].reshape(full, -1).to(dev))
            if t > full * g.page_size:
                rows[page_ids[full], :(t - full * g.page_size) * x[0].numel()] = x[full * g.page_size:].reshape(-1)

    def read_tokens(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [T, kv_heads, head_dim] at slots [T], dequantised to the compute dtype (never writes)."""
        g = self.geometry
        kv = self._layers[layer]
        pages, offsets = slots // g.page_size, slots % g.page_size
        k, v = kv.k[pages, offsets], kv.v[pages, offsets]
        if self.quantised:
            return (dequantize_fp8_ref(k, kv.k_scale[pages, offsets]).to(self.compute_dtype),
                    dequantize_fp8_ref(v, kv.v_scale[pages, offsets]).to(self.compute_dtype))
        return k.to(self.compute_dtype), v.to(self.compute_dtype)

    def read_stored(self, layer: int, page_ids: list[int], num_tokens: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """An FP8 pool's K, V [T, kv_heads, head_dim] of positions 0..num_tokens-1 under `page_ids` (a prompt's
        pages, in order) as stored (float8_e4m3fn) and their int8 exponents [T, kv_heads]: the bytes
        `write_tokens` copies in, with no dequantisation. Whole pages are copied (a contiguous row each, ~10x
        faster than gathering token by token) and cut at `num_tokens`. Never writes."""
        if not self.quantised:
            raise ValueError(f"a {self.format_name} pool stores no FP8 pages")
        g = self.geometry
        idx = torch.tensor(page_ids[:-(-num_tokens // g.page_size)], dtype=torch.int64, device=self.pages.device)
        k, v = (rows.index_select(0, idx).view(-1, g.num_kv_heads, g.head_dim)[:num_tokens].view(torch.float8_e4m3fn)
                for rows in self._page_rows[layer])
        k_exp, v_exp = (rows.index_select(0, idx).view(-1, g.num_kv_heads)[:num_tokens]
                        for rows in self._scale_rows[layer])
        return k, v, k_exp, v_exp

    def gather(self, layer: int, page_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [B, P * PAGE_SIZE, num_kv_heads, head_dim] (compute dtype) for page_table [B, P] (int64)."""
        b, p = page_table.shape
        g = self.geometry
        flat = page_table.reshape(-1)
        k_pages, v_pages = self._page_rows[layer]
        k, v = k_pages.index_select(0, flat), v_pages.index_select(0, flat)
        shape = (b, p * g.page_size, g.num_kv_heads, g.head_dim)
        if self.quantised:
            k_exp, v_exp = (rows.index_select(0, flat).view(b, p * g.page_size, g.num_kv_heads, 1)
                            for rows in self._scale_rows[layer])
            return (dequantize_fp8_table(k.view(shape), k_exp, self.compute_dtype),
                    dequantize_fp8_table(v.view(shape), v_exp, self.compute_dtype))
        k, v = k.view(shape), v.view(shape)
        if k.dtype != self.compute_dtype:
            k, v = k.to(self.compute_dtype), v.to(self.compute_dtype)
        return k, v


def pages_for_budget(cfg: ModelConfig, kv_format: str, kv_cache_bytes: int, page_size: int) -> int:
    """How many whole pages of `kv_format` fit in the byte budget (at least one, or InvalidRequest)."""
    if kv_format not in KV_FORMATS:
        raise InvalidRequest(f"unknown kv format {kv_format!r}; supported: {', '.join(KV_FORMATS)}")
    per_page = page_size * kv_bytes_per_token(cfg, kv_format)
    if kv_cache_bytes < per_page:
        raise InvalidRequest(f"kv cache budget {kv_cache_bytes} B is below one page ({per_page} B)")
    return kv_cache_bytes // per_page


def create_kv_cache(cfg: ModelConfig, kv_format: str, kv_cache_bytes: int, page_size: int,
                    compute_dtype: torch.dtype, device: torch.device | str = "cpu") -> PagedKVCache | LatentKVCache:
    """The one place a KV format is chosen: size the pool from the byte budget and allocate it
    (an MLA model gets a `LatentKVCache`, one latent row per token, with the same surface)."""
    num_pages = pages_for_budget(cfg, kv_format, kv_cache_bytes, page_size)
    if cfg.is_mla:
        from backend.latent_kv_cache import LatentKVCache

        return LatentKVCache(cfg, kv_format, num_pages, page_size, compute_dtype, device)
    return PagedKVCache(cfg, kv_format, num_pages, page_size, compute_dtype, device)
