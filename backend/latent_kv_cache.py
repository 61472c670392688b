"""Paged latent KV cache for multi-head latent attention (DeepseekV3, Kimi K2.x, GlmMoeDsa).

An MLA layer caches ONE row per token instead of per-head K and V: the
kv_a_layernorm-normalised latent c_kv (R = kv_lora_rank values) followed by the
roped key k_pe (Dr = qk_rope_head_dim values, in the interleaved-pair order of
`backend/rope.py`). Keys and values of every head are recovered from the row
(`backend/layers/mla.py`): prefill expands c_kv with kv_b_proj, decode folds
kv_b_proj into the query and the output (weight absorption) and attends over the
rows directly, with one KV "head" of R + Dr dims whose values are c_kv.

Storage, one tensor for the whole pool:
    pages: [num_layers, num_pages, PAGE_SIZE, row_elems]
A token's slot is ``page_id * PAGE_SIZE + offset``, as for the GQA cache
(`backend/kv_cache.py`), so the page allocator, its generation tags and the
integrity check cover latent pages unchanged.

Row formats (the names of the GQA cache, so `--kv-format` keeps its values):
- ``fp32`` / ``bf16``: R + Dr values of that dtype, [c_kv | k_pe].
- ``fp8_e4m3``: uint8 bytes [R e4m3 latent values | G = ceil(R/128) float32 scales |
  Dr bfloat16 rope values], R + 4G + 2Dr bytes (Kimi, DeepSeek-V3, GLM-5: 512 + 16
  + 128 = 656 B against BF16's 1,152 B). Group g scales latent values
  [128g, 128(g+1)) by amax_g / 448; the roped key stays bf16 because quantising it
  costs position resolution and it is only 1/9 of the values. The quantise /
  dequantise code and the store kernel live in `kernels/latent_kv_store.py`.

Models with the DSA lightning indexer (cfg.index_topk > 0) also keep the
indexer's key cache (`backend/indexer_cache.py`) here as `indexer`, on the same
page ids and slots; its bytes count in `bytes_per_token`.

Bytes per token = num_layers * (row bytes + indexer row bytes). Kimi K2.6
(61 layers): bf16 70,272 B, fp8_e4m3 40,016 B.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from backend.config import ModelConfig
from backend.errors import InvalidRequest
from backend.kv_cache import KV_FORMATS, KVGeometry
from backend.row_copies import index_copy_rows
from kernels.latent_kv_store import (check_latent_dims, dequantize_latent_ref, latent_row_bytes, latent_row_dtype,
                                     latent_row_elems, store_latent)

__all__ = ["LatentKVCache", "LatentRows", "latent_kv_bytes_per_token"]


class LatentRows(NamedTuple):
    """Raw rows of some tokens in one layer (what a prefill -> decode transfer moves per layer)."""

    rows: torch.Tensor  # [T, row elems] in `kv_format`'s row dtype (float32, bfloat16 or uint8)
    kv_format: str  # the latent row format of `rows` (kernels/latent_kv_store.py)
    kv_lora_rank: int
    rope_dim: int
    index_rows: torch.Tensor | None = None  # [T, indexer row bytes] uint8: the DSA indexer's keys (fp8)


def _check_format(cfg: ModelConfig, kv_format: str) -> None:
    if kv_format not in KV_FORMATS:
        raise InvalidRequest(f"unknown kv format {kv_format!r}; supported: {', '.join(KV_FORMATS)}")
    check_latent_dims(cfg.kv_lora_rank, cfg.qk_rope_head_dim, kv_format)  # fp8: kv_lora_rank % 4 == 0


def _indexer_bytes(cfg: ModelConfig) -> int:
    if not cfg.index_topk:
        return 0
    from backend.indexer_cache import IndexerKeyCache

    return IndexerKeyCache.bytes_per_token_per_layer(cfg)


def latent_kv_bytes_per_token(cfg: ModelConfig, kv_format: str) -> int:
    """Pool bytes one token occupies over all layers: the latent row, plus the indexer key (DSA)."""
    _check_format(cfg, kv_format)
    row = latent_row_bytes(cfg.kv_lora_rank, cfg.qk_rope_head_dim, kv_format)
    return cfg.num_layers * (row + _indexer_bytes(cfg))


class LatentKVCache:
    """The latent KV page store of one MLA worker (the `PagedKVCache` surface, one row per token).

    `store` writes the rows of new tokens at their slots (and only there). `gather` and
    `read_tokens` dequantise to the compute dtype and never write. `read_rows` /
    `write_rows` move raw rows (`LatentRows`, with the indexer's keys when there is an
    indexer) for the prefill -> decode transfer;
    `layer(i)` hands layer i's pages [num_pages, PAGE_SIZE, row_elems] to the kernels.
    """

    def __init__(self, cfg: ModelConfig, kv_format: str, num_pages: int, page_size: int,
                 compute_dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        _check_format(cfg, kv_format)
        self.format_name = kv_format
        self.quantised = kv_format == "fp8_e4m3"
        self.kv_lora_rank, self.rope_dim = cfg.kv_lora_rank, cfg.qk_rope_head_dim
        self.geometry = KVGeometry(cfg.num_layers, num_pages, page_size, 1, cfg.latent_dim)
        self.compute_dtype = compute_dtype
        self.bytes_per_token = latent_kv_bytes_per_token(cfg, kv_format)
        self.row_elems = latent_row_elems(cfg.kv_lora_rank, cfg.qk_rope_head_dim, kv_format)
        # [num_layers, num_pages, PAGE_SIZE, row_elems]
        self.pages = torch.zeros(cfg.num_layers, num_pages, page_size, self.row_elems,
                                 dtype=latent_row_dtype(kv_format), device=device)
        self._flat = [self.pages[i].view(-1, self.row_elems) for i in range(cfg.num_layers)]  # [slots, row_elems]
        self.indexer = None
        if cfg.index_topk:
            from backend.indexer_cache import IndexerKeyCache

            self.indexer = IndexerKeyCache(cfg, num_pages, page_size, device)

    @property
    def num_pages(self) -> int:
        return self.geometry.num_pages

    @property
    def page_size(self) -> int:
        return self.geometry.page_size

    @property
    def total_bytes(self) -> int:
        return self.num_pages * self.page_size * self.bytes_per_token

    def layer(self, i: int) -> torch.Tensor:
        """Layer i's pages [num_pages, PAGE_SIZE, row_elems] (pool dtype), as the kernels take them."""
        return self.pages[i]

    def store(self, layer: int, slots: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor) -> None:
        """Write latent [T, R] and roped keys k_pe [T, Dr] at slots [T] (int64) of `layer`."""
        store_latent(latent, k_pe, self.pages[layer], slots, self.format_name)  # Triton on CUDA

    def _values(self, rows: torch.Tensor) -> torch.Tensor:
        """Raw rows [..., row_elems] -> [..., R + Dr] = [c_kv | k_pe] in the compute dtype."""
        if not self.quantised:
            return rows if rows.dtype == self.compute_dtype else rows.to(self.compute_dtype)
        latent, k_pe = dequantize_latent_ref(rows, self.kv_lora_rank, self.rope_dim, self.format_name,
                                             self.compute_dtype)
        return torch.cat([latent, k_pe], dim=-1)

    def gather(self, layer: int, page_table: torch.Tensor) -> torch.Tensor:
        """Rows [B, P * PAGE_SIZE, R + Dr] ([c_kv | k_pe], compute dtype) of page_table [B, P] (int64)."""
        b, p = page_table.shape
        rows = self.pages[layer].index_select(0, page_table.reshape(-1))  # whole contiguous pages
        return self._values(rows.view(b, p * self.page_size, self.row_elems))

    def read_tokens(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latent [T, R] and k_pe [T, Dr] at slots [T], dequantised to the compute dtype (never writes)."""
        values = self._values(self._flat[layer].index_select(0, slots.to(self.pages.device)))
        return values[:, : self.kv_lora_rank], values[:, self.kv_lora_rank:]

    def write_tokens(self, layer: int, slots: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor) -> None:
        """Install latent [T, R] and k_pe [T, Dr] values at slots [T] (quantised if the pool is FP8)."""
        self.store(layer, slots, latent.to(self.compute_dtype), k_pe.to(self.compute_dtype))

    def read_rows(self, layer: int, slots: torch.Tensor) -> LatentRows:
        """Raw rows [T, row_elems] in the pool format at slots [T], with the indexer's rows (a copy;
        never writes)."""
        slots = slots.to(self.pages.device)
        index_rows = self.indexer.read_tokens(layer, slots) if self.indexer is not None else None
        return LatentRows(self._flat[layer].index_select(0, slots), self.format_name, self.kv_lora_rank,
                          self.rope_dim, index_rows)

    def write_rows(self, layer: int, slots: torch.Tensor, rows: LatentRows) -> None:
        """Install rows at slots [T]: copied byte for byte when they are in the pool's format, else
        dequantised (float32) and stored in the pool format; the indexer's rows byte for byte."""
        if (rows.kv_lora_rank, rows.rope_dim) != (self.kv_lora_rank, self.rope_dim):
            raise InvalidRequest(f"latent rows of R {rows.kv_lora_rank}, Dr {rows.rope_dim} do not fit this pool's "
                                 f"R {self.kv_lora_rank}, Dr {self.rope_dim}")
        if (rows.index_rows is None) != (self.indexer is None):
            raise InvalidRequest("latent rows and pool disagree on having DSA indexer keys")
        slots = slots.to(self.pages.device)
        if rows.kv_format == self.format_name:
            if rows.rows.shape[1:] != (self.row_elems,) or rows.rows.dtype != self.pages.dtype:
                raise InvalidRequest(f"{rows.kv_format} latent rows must be [T, {self.row_elems}] {self.pages.dtype}, "
                                     f"got {tuple(rows.rows.shape)} {rows.rows.dtype}")
            index_copy_rows(self._flat[layer], 0, slots, rows.rows.to(self.pages.device))
        else:
            latent, k_pe = dequantize_latent_ref(rows.rows, self.kv_lora_rank, self.rope_dim, rows.kv_format,
                                                 torch.float32)
            self.write_tokens(layer, slots, latent.to(self.pages.device), k_pe.to(self.pages.device))
        if self.indexer is not None:
            self.indexer.write_tokens(layer, slots, rows.index_rows.to(self.pages.device))
