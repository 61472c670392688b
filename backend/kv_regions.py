"""Where a KV pool's bytes live, as byte runs a remote writer can address directly.

A direct KV transfer (`mooncake_transfer.py`) writes a prefill worker's pages into a
decode worker's reserved pages byte for byte, with no intermediate copy. For that the
writer needs the reader's memory layout: each pool tensor is a *region*

    region[layer, part, page, token, ...]   (part: K = 0, V = 1; one part for latent rows)

with byte strides for layer, part and page, and ``token_bytes`` bytes per token of
one (layer, part). `PagedKVCache` has two regions, ``values`` [L, 2, P, S, H, D] and,
for FP8, ``scales`` [L, 2, P, S, H] (int8 exponents); `LatentKVCache` has ``latent``
[L, P, S, row] and, with a DSA indexer, ``index`` [L, P, S, row_bytes].

Two pools can take a direct copy when they hold the same format, layer count and
regions with the same bytes per token (`incompatibility`); page sizes may differ.
`layers_runs` cuts the prompt's tokens [0, T) at the page boundaries of both sides and
returns one (source address, destination address, length) run per piece, region, part
and layer, merging pieces that are adjacent on both sides (consecutive pages): with equal
page sizes and a fresh pool a layer is a handful of runs, at worst one per page. It does
so for several consecutive layers at once (cut at the first, moved to the others by the
layer strides: one batched write carries them).
Only the prompt's own tokens are written, never the unused tail of a last page.
"""

from __future__ import annotations

import msgspec
import torch

__all__ = ["KVRegion", "KVLayout", "pool_layout", "pool_tensors", "incompatibility", "layers_runs", "layer_bytes"]


class KVRegion(msgspec.Struct, frozen=True):
    """One pool tensor: byte address and strides (see the module docstring)."""

    name: str
    base: int
    nbytes: int
    parts: int
    layer_stride: int
    part_stride: int
    page_stride: int
    token_bytes: int


class KVLayout(msgspec.Struct, frozen=True):
    """A pool's format and regions: what a direct writer needs to address its pages."""

    kv_format: str
    num_layers: int
    page_size: int
    regions: list[KVRegion]


def _region(name: str, t: torch.Tensor, parts: int) -> KVRegion:
    """A region from a contiguous tensor [L, (parts,) P, S, ...]."""
    if not t.is_contiguous():
        raise ValueError(f"KV region {name} is not contiguous")
    e = t.element_size()
    page_dim = 2 if parts > 1 else 1
    stride = t.stride()
    return KVRegion(name, t.data_ptr(), t.numel() * e, parts, stride[0] * e, stride[1] * e if parts > 1 else 0,
                    stride[page_dim] * e, stride[page_dim + 1] * e)


def _named_tensors(cache: object) -> list[tuple[str, torch.Tensor, int]]:
    from backend.latent_kv_cache import LatentKVCache

    if isinstance(cache, LatentKVCache):
        out = [("latent", cache.pages, 1)]
        if cache.indexer is not None:
            out.append(("index", cache.indexer.pages, 1))
        return out
    out = [("values", cache.pages, 2)]
    if cache.scales is not None:
        out.append(("scales", cache.scales, 2))
    return out


def pool_tensors(cache: object) -> list[torch.Tensor]:
    """The tensors holding a pool's bytes (to register with a transfer engine once)."""
    return [t for _, t, _ in _named_tensors(cache)]


def pool_layout(cache: object) -> KVLayout:
    """The layout of a `PagedKVCache` or `LatentKVCache`."""
    regions = [_region(name, t, parts) for name, t, parts in _named_tensors(cache)]
    return KVLayout(cache.format_name, cache.geometry.num_layers, cache.page_size, regions)


def incompatibility(src: KVLayout, dst: KVLayout) -> str | None:
    """Why `src` pages cannot be copied byte for byte into `dst` pages, or None when they can."""
    if src.kv_format != dst.kv_format:
        return f"KV formats differ ({src.kv_format} -> {dst.kv_format})"
    if src.num_layers != dst.num_layers:
        return f"layer counts differ ({src.num_layers} -> {dst.num_layers})"
    shape = lambda lay: [(r.name, r.parts, r.token_bytes) for r in lay.regions]  # noqa: E731
    if shape(src) != shape(dst):
        return f"pool regions differ ({shape(src)} -> {shape(dst)})"
    return None


def _pieces(src_pages: list[int], src_ps: int, dst_pages: list[int], dst_ps: int, num_tokens: int
            ) -> list[tuple[int, int, int, int, int]]:
    """(src page, src offset, dst page, dst offset, tokens) pieces covering tokens [0, num_tokens)."""
    out, t = [], 0
    while t < num_tokens:
        sp, so = divmod(t, src_ps)
        dp, do = divmod(t, dst_ps)
        n = min(src_ps - so, dst_ps - do, num_tokens - t)
        out.append((src_pages[sp], so, dst_pages[dp], do, n))
        t += n
    return out


def layer_bytes(layout: KVLayout, num_tokens: int) -> int:
    """The bytes of one layer of `num_tokens` tokens in `layout`'s pool (what `layers_runs` moves a layer)."""
    return num_tokens * sum(r.parts * r.token_bytes for r in layout.regions)


def layers_runs(src: KVLayout, src_pages: list[int], dst: KVLayout, dst_pages: list[int], layers: range,
                num_tokens: int) -> tuple[list[int], list[int], list[int]]:
    """Byte runs (source addresses, destination addresses, lengths) copying layers `layers` (consecutive,
    ascending) of a prompt's `num_tokens` tokens from `src_pages` to `dst_pages` (layouts must be compatible),
    layer after layer. The runs are cut once, at the first layer, and moved to the others by each region's layer
    strides: every layer of a pool has the same layout, so this is the same as cutting each (a 1,024-token
    prompt has 64 pieces per region and part: cutting all 30 layers of SmolLM2 anew took ~4 ms of Python)."""
    need_src, need_dst = -(-num_tokens // src.page_size), -(-num_tokens // dst.page_size)
    if len(src_pages) < need_src or len(dst_pages) < need_dst:
        raise ValueError(f"{num_tokens} tokens need {need_src} source and {need_dst} destination pages, "
                         f"got {len(src_pages)} and {len(dst_pages)}")
    pieces = _pieces(src_pages, src.page_size, dst_pages, dst.page_size, num_tokens)
    base: list[tuple[int, int, list[tuple[int, int, int]]]] = []  # per region: its layer strides and first runs
    for rs, rd in zip(src.regions, dst.regions):
        tb, runs = rs.token_bytes, []
        for part in range(rs.parts):
            s0 = rs.base + layers.start * rs.layer_stride + part * rs.part_stride
            d0 = rd.base + layers.start * rd.layer_stride + part * rd.part_stride
            first = len(runs)
            for sp, so, dp, do, n in pieces:
                s, d, ln = s0 + sp * rs.page_stride + so * tb, d0 + dp * rd.page_stride + do * tb, n * tb
                if len(runs) > first and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
                    runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + ln)  # adjacent on both sides: one run
                else:
                    runs.append((s, d, ln))
        base.append((rs.layer_stride, rd.layer_stride, runs))
    srcs: list[int] = []
    dsts: list[int] = []
    lens: list[int] = []
    for i in range(len(layers)):
        for s_stride, d_stride, runs in base:
            srcs += [s + i * s_stride for s, _, _ in runs]
            dsts += [d + i * d_stride for _, d, _ in runs]
            lens += [n for _, _, n in runs]
    return srcs, dsts, lens
