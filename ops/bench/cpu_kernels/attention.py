"""`bench cpu-kernels`' attention and prompt sections: the paged attention kernel against torch's SDPA path."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ops.bench.cpu_kernels.timing import alternate, in_step, result_row
from ops.bench.harness.progress import log

__all__ = ["bench_attention", "bench_prompt", "PAGE_SIZE"]

PAGE_SIZE = 16  # the engine's default (`EngineConfig.page_size`)


def _random_cache(cfg: Any, fmt: str, num_pages: int) -> Any:
    """The engine's own page pool (`PagedKVCache`, every layer) filled with random keys and values."""
    from backend.kv_cache import PagedKVCache

    cache = PagedKVCache(cfg, fmt, num_pages, PAGE_SIZE, torch.bfloat16)
    x = torch.randn(cache.pages.shape)
    if cache.quantised:
        cache.pages.copy_(x.mul_(64).clamp_(-448, 448).to(torch.float8_e4m3fn))
        cache.scales.copy_(torch.randint(-8, 0, cache.scales.shape, dtype=torch.int8))
    else:
        cache.pages.copy_(x)
    return cache


def _attention_row(key: str, section: str, shape: str, ours: Callable[[], Any], theirs: Callable[[], Any],
                   reps: int, kv_bytes: float, others: dict[str, Callable[[], Any]] | None = None) -> dict[str, Any]:
    """The kernel (as in a decode step) against torch's path, and where its AMX tiles take the rows (this process
    runs them: `amx_default`) its vector copy as a third arm (`vector_ms`, `vector_over_c`: > 1, the tiles are
    faster); `others`: more ways of running the kernel, each an arm (`NAME_ms`, `NAME_over_c`)."""
    from kernels.cpu_paged_attention import amx_default, amx_tiles

    calls = {"c": in_step(ours), "torch": theirs, **{name: in_step(f) for name, f in (others or {}).items()}}
    if amx_default() and amx_tiles(True):

        def vector() -> Any:
            amx_tiles(False)
            try:
                return ours()
            finally:
                amx_tiles(True)
        calls["vector"] = in_step(vector)
    times = alternate(calls, reps)
    row = result_row(key, section, "paged_decode_attention_cpu", shape, times, kv_bytes, "GB/s")
    for name in [*(others or {}), *(["vector"] if "vector" in times else [])]:
        ms = statistics.median(times[name]) * 1e3
        row.update({f"{name}_ms": ms, f"{name}_over_c": ms / row["c_ms"],
                    f"{name}_ms_runs": [x * 1e3 for x in times[name]]})
    log(f"  {key}: C {row['c_ms']:.1f} ms, torch {row['torch_ms']:.1f} ms"
        + "".join(f", {name} {row[name + '_ms']:.1f} ms ({row[name + '_over_c']:.2f}x C's)" for name in others or {})
        + (f", the C vector copy {row['vector_ms']:.1f} ms (AMX tiles {row['vector_over_c']:.2f}x faster)"
           if "vector_ms" in row else ""))
    return row


def _kv_bytes(cache: Any, layers: int, rows: int, kvh: int, hd: int) -> int:
    """Bytes of K and V pages (and FP8 exponents) `rows` token rows of every layer hold."""
    return layers * 2 * rows * kvh * (hd * (1 if cache.quantised else 2) + cache.quantised)


def bench_attention(cfg: Any, d: int, context: int, reps: int) -> list[dict[str, Any]]:
    from backend.attention import context_mask
    from kernels.cpu_paged_attention import paged_decode_attention_cpu

    heads, kvh, hd, layers = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers
    scale = hd ** -0.5
    pages_per_seq = -(-context // PAGE_SIZE)
    table = torch.randperm(d * pages_per_seq).view(d, pages_per_seq)  # pages in a shuffled order
    lens = torch.full((d,), context, dtype=torch.int32)
    q = torch.randn(d, heads, hd).bfloat16()
    mask = context_mask(lens, pages_per_seq, PAGE_SIZE, q.dtype)
    out = []
    for fmt in ("bf16", "fp8_e4m3"):
        cache = _random_cache(cfg, fmt, d * pages_per_seq)

        def ours(cache: Any = cache) -> list:
            return [paged_decode_attention_cpu(q, kv.k, kv.v, kv.k_scale, kv.v_scale, table, lens, scale)
                    for kv in map(cache.layer, range(layers))]

        def theirs(cache: Any = cache) -> list:  # backend/attention.py's path without the kernel
            qd = q.view(d, kvh, heads // kvh, hd)
            return [F.scaled_dot_product_attention(qd, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                                   scale=scale)
                    for k, v in (cache.gather(i, table) for i in range(layers))]

        row = _attention_row(f"attention_{fmt}", "attention", f"{fmt} pages, {d} seq x {context} keys x {layers} "
                             "layers", ours, theirs, reps, _kv_bytes(cache, layers, d * context, kvh, hd))
        row.update(format=fmt, rows=d, context=context)
        out.append(row)
        del cache
    return out


def bench_prompt(cfg: Any, n: int, prefix: int, reps: int) -> list[dict[str, Any]]:
    """A prompt chunk of n rows after `prefix` cached keys, in the kernel's tiles as the engine groups them
    (`tile_rows`), against backend/attention.py's torch path for a chunk (its pages gathered once, SDPA under the
    causal mask with the prefix), bf16 queries over bf16 and fp8 pages. Over fp8 pages the kernel runs as the
    engine runs it, over the chunk's pages dequantised first (`dequantised_pages`), and over the fp8 pages in
    place as another arm (`in_place_ms`)."""
    from kernels.cpu_paged_attention import dequantised_pages, dequantises, paged_decode_attention_cpu, tile_rows

    heads, kvh, hd, layers = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers
    g, ctx, scale = heads // kvh, prefix + n, hd ** -0.5
    pages = -(-ctx // PAGE_SIZE)
    table = torch.randperm(pages).view(1, pages).expand(n, pages).contiguous()  # every row the sequence's pages
    lens = torch.arange(prefix + 1, ctx + 1, dtype=torch.int32)  # row i sees the keys up to its own position
    tiles = torch.tensor([*range(0, n, tile_rows(g)), n], dtype=torch.int32)
    q = torch.randn(n, heads, hd).bfloat16()
    mask = torch.arange(ctx).unsqueeze(0) <= torch.arange(prefix, ctx).repeat(g).unsqueeze(1)  # [g n, ctx]
    out = []
    for fmt in ("bf16", "fp8_e4m3"):
        cache = _random_cache(cfg, fmt, pages)

        def in_place(cache: Any = cache) -> list:
            return [paged_decode_attention_cpu(q, kv.k, kv.v, kv.k_scale, kv.v_scale, table, lens, scale, tiles=tiles)
                    for kv in map(cache.layer, range(layers))]

        def dequantised(cache: Any = cache) -> list:  # backend/attention.py's path over fp8 pages
            own = torch.arange(pages).expand(n, pages)
            return [paged_decode_attention_cpu(q, dequantised_pages(kv.k, kv.k_scale, table[0], q.dtype),
                                               dequantised_pages(kv.v, kv.v_scale, table[0], q.dtype), None, None,
                                               own, lens, scale, tiles=tiles)
                    for kv in map(cache.layer, range(layers))]

        def theirs(cache: Any = cache) -> list:
            qp = q.permute(1, 0, 2).reshape(1, kvh, g * n, hd)
            return [F.scaled_dot_product_attention(qp, k[:, :ctx].transpose(1, 2), v[:, :ctx].transpose(1, 2),
                                                   attn_mask=mask, scale=scale)
                    for k, v in (cache.gather(i, table[:1]) for i in range(layers))]

        deq = cache.quantised and dequantises(hd)
        row = _attention_row(f"prompt_{fmt}_{prefix}", "prompt", f"{fmt} pages, {n} rows after {prefix} keys x "
                             f"{layers} layers", dequantised if deq else in_place, theirs, reps,
                             _kv_bytes(cache, layers, ctx, kvh, hd), {"in_place": in_place} if deq else None)
        row.update(format=fmt, rows=n, prefix=prefix)
        out.append(row)
        del cache
    return out
