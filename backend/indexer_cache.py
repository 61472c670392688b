"""The DSA lightning indexer's paged key cache (GlmMoeDsa / DeepSeek-V3.2 sparse attention).

Each layer's indexer keeps one key of `index_head_dim` values per token (LayerNorm'd,
RoPE'd on its first `qk_rope_head_dim` dims), cached beside the latent KV pages with the
SAME page ids and slots (slot = page_id * page_size + offset), so the page allocator,
the generation tags and the integrity check that cover the latent pages cover these
rows too: a page that changes owner changes for both caches at once.

Pool, one tensor per worker:
    pages: [num_layers, num_pages, page_size, row_bytes] uint8

Formats:
- ``fp8_e4m3`` (the serving format; vLLM's and SGLang's indexer cache): a row is
  ``index_head_dim`` e4m3 values followed by ONE float32 scale for the token,
  row_bytes = index_head_dim + 4 (132 B for GLM-5's 128-dim keys):
      amax   = max |k| over the token's index_head_dim values (float32)
      scale  = amax / 448            (1.0 when amax == 0)
      stored = float8_e4m3fn(clamp(k / scale, -448, 448))   (round to nearest even)
      k'     = float(stored) * scale
  The token's largest value lands on 448 exactly, so every value keeps e4m3's 3
  mantissa bits (relative error <= 2**-4) down to amax / 2**14. The indexer only
  ranks keys (top-k of relu'd dot products), so this precision moves a selection only
  where two keys' scores nearly tie; tests/backend/test_dsa_indexer.py measures it.
- ``fp32``: the key as float32 bytes, row_bytes = 4 * index_head_dim. Exact; used to
  check parity against transformers (which scores un-quantised keys in prefill).

The views of an fp8 row: ``row[..., :D].view(float8_e4m3fn)`` and
``row[..., D:D+4].view(float32)``.
"""

from __future__ import annotations

import torch

from backend.config import ModelConfig
from backend.errors import InvalidRequest
from backend.row_copies import index_copy_rows
from kernels.exact_div import div_exact

__all__ = ["INDEXER_KEY_FORMATS", "IndexerKeyCache", "quantize_index_keys", "dequantize_index_keys"]

INDEXER_KEY_FORMATS = ("fp8_e4m3", "fp32")
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_index_keys(k: torch.Tensor) -> torch.Tensor:
    """k [T, D] float -> fp8 rows [T, D + 4] uint8 (e4m3 values | float32 scale), per the module doc."""
    kf = k.float()
    amax = kf.abs().amax(dim=-1, keepdim=True)  # [T, 1]
    scale = torch.where(amax > 0, div_exact(amax, FP8_MAX), torch.ones_like(amax))  # alike on every device
    q = (kf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return torch.cat([q.view(torch.uint8), scale.contiguous().view(torch.uint8)], dim=-1)


def dequantize_index_keys(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """fp8 rows [..., D + 4] uint8 -> keys [..., D] float32."""
    values = rows[..., :head_dim].contiguous().view(torch.float8_e4m3fn).float()
    scale = rows[..., head_dim:head_dim + 4].contiguous().view(torch.float32)  # [..., 1]
    return values * scale


class IndexerKeyCache:
    """One worker's indexer keys, paged like (and indexed by the slots of) the latent KV pages.

    `store` writes new tokens' keys at their slots (mutates those rows only); `gather`
    dequantises whole pages in page-table order and never writes; `read_tokens` /
    `write_tokens` move raw rows for the prefill -> decode KV transfer.
    """

    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int,
                 device: torch.device | str = "cpu", key_format: str = "fp8_e4m3") -> None:
        if not cfg.index_topk or cfg.index_head_dim <= 0:
            raise InvalidRequest(f"{cfg.architecture} has no DSA indexer (index_topk {cfg.index_topk})")
        if key_format not in INDEXER_KEY_FORMATS:
            raise InvalidRequest(f"unknown indexer key format {key_format!r}; "
                                 f"supported: {', '.join(INDEXER_KEY_FORMATS)}")
        self.key_format = key_format
        self.head_dim = cfg.index_head_dim
        self.num_layers, self.num_pages, self.page_size = cfg.num_layers, num_pages, page_size
        self.row_bytes = self.bytes_per_token_per_layer(cfg, key_format)
        # [num_layers, num_pages, page_size, row_bytes]
        self.pages = torch.zeros(cfg.num_layers, num_pages, page_size, self.row_bytes,
                                 dtype=torch.uint8, device=device)

    @staticmethod
    def bytes_per_token_per_layer(cfg: ModelConfig, key_format: str = "fp8_e4m3") -> int:
        """Row bytes of one token in one layer: index_head_dim + 4 (fp8; 132 for GLM-5), 4 * dim (fp32)."""
        return cfg.index_head_dim + 4 if key_format == "fp8_e4m3" else 4 * cfg.index_head_dim

    @property
    def bytes_per_token(self) -> int:
        """Pool bytes one token occupies over all layers."""
        return self.num_layers * self.row_bytes

    @property
    def total_bytes(self) -> int:
        return self.pages.numel()

    def encode(self, k: torch.Tensor) -> torch.Tensor:
        """Keys [T, index_head_dim] -> raw rows [T, row_bytes] uint8 in this cache's format."""
        if k.dim() != 2 or k.shape[1] != self.head_dim or not k.dtype.is_floating_point:
            raise InvalidRequest(f"indexer keys must be float [T, {self.head_dim}], got "
                                 f"{tuple(k.shape)} {k.dtype}")
        if self.key_format == "fp8_e4m3":
            return quantize_index_keys(k)
        return k.float().contiguous().view(torch.uint8)

    def decode(self, rows: torch.Tensor) -> torch.Tensor:
        """Raw rows [..., row_bytes] -> keys [..., index_head_dim] float32."""
        if self.key_format == "fp8_e4m3":
            return dequantize_index_keys(rows, self.head_dim)
        return rows.contiguous().view(torch.float32)

    def _check_slots(self, slots: torch.Tensor, count: int) -> None:
        if slots.shape != (count,) or slots.dtype != torch.int64:
            raise InvalidRequest(f"slots must be [{count}] int64, got {tuple(slots.shape)} {slots.dtype}")

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor) -> None:
        """Write keys k [T, index_head_dim] at slots [T] (int64) of `layer`."""
        rows = self.encode(k)
        self._check_slots(slots, rows.shape[0])
        index_copy_rows(self.pages[layer].view(-1, self.row_bytes), 0, slots.to(self.pages.device),
                        rows.to(self.pages.device))

    def gather(self, layer: int, page_table: torch.Tensor) -> torch.Tensor:
        """Keys [B, P * page_size, index_head_dim] float32 of page_table [B, P] (int32/int64) pages."""
        b, p = page_table.shape
        rows = self.pages[layer].index_select(0, page_table.reshape(-1).long())  # [B*P, page, row]
        return self.decode(rows.view(b, p * self.page_size, self.row_bytes))

    def read_tokens(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """Raw rows [T, row_bytes] uint8 at slots [T] (a copy; never writes)."""
        self._check_slots(slots, slots.numel())
        return self.pages[layer].view(-1, self.row_bytes).index_select(0, slots.to(self.pages.device))

    def write_tokens(self, layer: int, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Install raw rows [T, row_bytes] uint8 (from `read_tokens` of a cache of the same format)
        at slots [T], byte for byte."""
        if rows.dim() != 2 or rows.shape[1] != self.row_bytes or rows.dtype != torch.uint8:
            raise InvalidRequest(f"indexer rows must be uint8 [T, {self.row_bytes}] ({self.key_format}), "
                                 f"got {tuple(rows.shape)} {rows.dtype}")
        self._check_slots(slots, rows.shape[0])
        index_copy_rows(self.pages[layer].view(-1, self.row_bytes), 0, slots.to(self.pages.device),
                        rows.to(self.pages.device))
