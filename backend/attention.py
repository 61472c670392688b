"""Attention over the paged KV cache for one mixed step (torch path, the CPU runtime).

A step is a flat batch of T tokens: first one token per decoding sequence, then
chunks of prompts being prefilled. `StepMetadata` is built once per step by the
model runner and shared by every layer.

Decode on CUDA: the Triton kernel `kernels/paged_attention.py` reads the pages
in place (GQA-grouped, split-KV, dequantised in registers).

Decode on CPU (D sequences, one query token each): the C kernel
`kernels/cpu_paged_attention.py` walks each sequence's pages in place (FP8 rows
dequantised one at a time in L1, online softmax, no copy of the context). Where it
is not built (no C compiler), the sequences' pages are gathered as whole pages
(contiguous copies, dequantised) into [D, P*PAGE_SIZE, kv_heads, head_dim], keys
past each context length are masked out, and SDPA runs with the G = heads/kv_heads
query heads of one KV head laid out as G query "rows" against that head,
q: [D, kv_heads, G, head_dim].

Prefill: a chunk's K/V are already stored, so the keys are the sequence's first
`context_len` slots (cached prefix + this chunk); query i sits at position
`start + i` and sees keys 0..start+i (causal with an offset). On CPU that makes a
prompt row a decode query whose context ends at its own position, so a step with
prompt chunks runs the same C kernel once for all its rows (`StepMetadata.row_pages`:
every row's page table and context length; `StepMetadata.row_tiles` groups a chunk's rows
into tiles that the kernel runs against each block of keys together), reading the pages in
place. Against the
torch path below it had, on a 2-core AMD EPYC VM (SmolLM2, bfloat16 pages, 31 decode
rows plus one prompt chunk, the two paths alternating step by step, medians of 6):
0.92x the step's time at 64 prompt tokens, 0.89x at 97, 0.92x at 150, 0.99x at 256;
its error against float64 attention was bfloat16's rounding of the result alone
(mean 3.6e-4 at 150 x 200 keys, SDPA's 4.5e-4). Over FP8 pages the prompt rows instead
read their chunks' pages dequantised once per layer (`dequantised_pages`: code x 2^e,
exact in the compute dtype, ~30 us for 64 pages) and the decode rows read the FP8 pages
in place in a call of their own (the bits a step without prompts gives them): a chunk's
tiles each read every key, and in place each converted it again (SmolLM2, 512 rows
after 512 keys, 30 layers, 2-core AMX Xeon VM: 173 -> 80 ms, BF16 pages' 73; the same
bits, `tests/kernels/test_cpu_paged_attention.py`). Elsewhere (CUDA, no C kernel) each
chunk gathers its pages and runs SDPA with the G query heads of a KV head stacked
into G*n query rows against it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.nn.functional as F

from backend.kv_cache import PagedKVCache
from kernels.cpu_paged_attention import dequantised_pages, paged_decode_attention_cpu, tile_rows

__all__ = ["PrefillChunk", "StepMetadata", "paged_attention"]


@dataclass
class PrefillChunk:
    """One sequence's prompt chunk inside the flat batch."""

    token_start: int  # first row of this chunk in the flat batch
    num_tokens: int
    context_len: int  # tokens in the cache after this chunk (prefix + chunk)
    page_table: torch.Tensor  # [1, P] int64, pages covering context_len


def context_mask(context_lens: torch.Tensor, num_pages: int, page_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive attention mask [D, 1, 1, num_pages * page_size] in `dtype`: 0 for keys within each row's
    context length, -inf past it."""
    beyond = torch.arange(num_pages * page_size, device=context_lens.device).view(1, 1, 1, -1) \
        >= context_lens.view(-1, 1, 1, 1)
    return torch.zeros(beyond.shape, dtype=dtype, device=context_lens.device).masked_fill_(beyond, float("-inf"))


@dataclass
class StepMetadata:
    """Everything the layers need to know about the step's batch."""

    positions: torch.Tensor  # [T] int64
    slots: torch.Tensor  # [T] int64, where each token's K/V is written
    num_decode: int  # decode rows: rows 0..num_decode-1 of the flat batch, prompt chunks after them
    decode_page_table: torch.Tensor | None  # [D, P] int64 (padded with page 0)
    decode_context_lens: torch.Tensor | None  # [D] int32, keys each decoding sequence attends to
    prefills: list[PrefillChunk]
    logits_rows: torch.Tensor  # [R] int64, rows whose logits are sampled: the decode rows first, in order (then any scored prompt rows)
    page_size: int  # the cache's tokens per page (`decode_mask`'s width: P * page_size)
    mask_dtype: torch.dtype  # the compute dtype (`decode_mask`'s)
    _tiles: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    _prompt_pages: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict, repr=False)

    @cached_property
    def decode_mask(self) -> torch.Tensor | None:
        """The decode rows' additive attention mask [D, 1, 1, P * page_size] (0, or -inf for keys past each
        row's context length), for the paths that take one (SDPA over gathered pages, MLA): built on first
        use, once per step (SDPA would convert a bool mask in every layer), and not at all in a step the C
        kernel or the Triton kernel runs (they read the lengths)."""
        if not self.num_decode:
            return None
        return context_mask(self.decode_context_lens, self.decode_page_table.shape[1], self.page_size,
                            self.mask_dtype)

    @cached_property
    def row_pages(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's page table [T, P] (int64, zero-padded) and keys [T] (int32): a decode row's whole
        context; a prompt row at position p sees keys 0..p. Built on first use, once per step."""
        tables, lens = [], []
        if self.num_decode:
            tables.append(self.decode_page_table)
            lens.append(self.decode_context_lens.to(torch.int32))
        for c in self.prefills:
            tables.append(c.page_table.expand(c.num_tokens, -1))
            lens.append(torch.arange(c.context_len - c.num_tokens + 1, c.context_len + 1, dtype=torch.int32,
                                     device=c.page_table.device))
        width = max(t.shape[1] for t in tables)
        return torch.cat([F.pad(t, (0, width - t.shape[1])) for t in tables]), torch.cat(lens)

    def row_tiles(self, per_tile: int) -> torch.Tensor:
        """First rows [n + 1] (int32, then T) of the step's tiles for the C kernel: each decode row alone, each
        prompt chunk cut into runs of `per_tile` rows (rows of one chunk share its pages and see one more key
        each). Built once per step and size."""
        if per_tile not in self._tiles:
            starts = list(range(self.num_decode))
            for c in self.prefills:
                starts.extend(range(c.token_start, c.token_start + c.num_tokens, per_tile))
            end = self.num_decode + sum(c.num_tokens for c in self.prefills)
            self._tiles[per_tile] = torch.tensor(starts + [end], dtype=torch.int32)
        return self._tiles[per_tile]

    def prompt_pages(self, per_tile: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The prompt rows alone over a pool of their chunks' pages in order (`dequantised_pages`): the pages'
        ids [P] (each chunk's table, one after the other), then as `kernel_rows` for those rows, each chunk's
        table now its own run of that pool: table [T_p, P_max], keys [T_p] (int32), tiles [n + 1] (int32).
        Built once per step and size."""
        if per_tile not in self._prompt_pages:
            ids, tables, lens, starts, first, row = [], [], [], [], 0, 0
            for c in self.prefills:
                p = c.page_table.shape[1]
                ids.append(c.page_table.reshape(-1))
                tables.append(torch.arange(first, first + p).expand(c.num_tokens, -1))
                lens.append(torch.arange(c.context_len - c.num_tokens + 1, c.context_len + 1, dtype=torch.int32))
                starts.extend(range(row, row + c.num_tokens, per_tile))
                first, row = first + p, row + c.num_tokens
            width = max(t.shape[1] for t in tables)
            table = torch.cat([F.pad(t, (0, width - t.shape[1])) for t in tables])
            self._prompt_pages[per_tile] = (torch.cat(ids), table, torch.cat(lens),
                                            torch.tensor(starts + [row], dtype=torch.int32))
        return self._prompt_pages[per_tile]

    def kernel_rows(self, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """What the CPU attention kernel takes for this step's rows with `group` query heads a KV head: page
        table, keys per row and tiles; a step of decode rows only: their own table and lengths, no tiles."""
        if not self.prefills:
            return self.decode_page_table, self.decode_context_lens, None
        table, lens = self.row_pages
        return table, lens, self.row_tiles(tile_rows(group))


def paged_attention(q: torch.Tensor, cache: PagedKVCache, layer: int, meta: StepMetadata,
                    scale: float) -> torch.Tensor:
    """Attention output [T, heads, head_dim] for queries q [T, heads, head_dim]."""
    t, num_heads, head_dim = q.shape
    num_kv_heads = cache.geometry.num_kv_heads
    group = num_heads // num_kv_heads
    d = meta.num_decode
    if meta.prefills and not q.is_cuda:  # prompt rows too: one C call for the step, two over FP8 pages (docstring)
        kv = cache.layer(layer)
        o = _over_dequantised_pages(q, cache, layer, meta, scale) if cache.quantised else None
        if o is None:
            table, lens, tiles = meta.kernel_rows(group)
            o = paged_decode_attention_cpu(q, kv.k, kv.v, kv.k_scale, kv.v_scale, table, lens, scale, tiles=tiles)
        if o is not None:
            return o.to(q.dtype)
    if d and q.is_cuda:  # Triton: pages read (and dequantised) inside the kernel, no gather
        from kernels.paged_attention import paged_decode_attention

        kv = cache.layer(layer)
        o = paged_decode_attention(q[:d], kv.k, kv.v, kv.k_scale, kv.v_scale,
                                   meta.decode_page_table.to(torch.int32), meta.decode_context_lens, scale)
    elif d:
        kv = cache.layer(layer)
        o = paged_decode_attention_cpu(q[:d], kv.k, kv.v, kv.k_scale, kv.v_scale, meta.decode_page_table,
                                       meta.decode_context_lens, scale)
        if o is not None:
            o = o.to(q.dtype)
        else:  # no C kernel here: gather the pages (dequantised) and run SDPA
            k, v = cache.gather(layer, meta.decode_page_table)  # [D, L, kv_heads, head_dim]
            qd = q[:d].view(d, num_kv_heads, group, head_dim)
            o = F.scaled_dot_product_attention(qd, k.transpose(1, 2), v.transpose(1, 2),
                                               attn_mask=meta.decode_mask, scale=scale)
    if d and not meta.prefills:  # a pure decode step: no scatter into a shared output
        return o.reshape(d, num_heads, head_dim)
    out = torch.empty_like(q)
    if d:
        out[:d] = o.reshape(d, num_heads, head_dim)
    for chunk in meta.prefills:
        rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
        n, ctx = chunk.num_tokens, chunk.context_len
        k, v = cache.gather(layer, chunk.page_table)
        k = k[:, :ctx].transpose(1, 2)  # [1, kv_heads, ctx, head_dim]
        v = v[:, :ctx].transpose(1, 2)
        # the G query heads of one KV head become G*n query rows against it: [1, kv_heads, G*n, head_dim]
        qp = q[rows].permute(1, 0, 2).reshape(1, num_kv_heads, group * n, head_dim)
        start = ctx - n
        qpos = torch.arange(start, ctx, device=q.device).repeat(group).unsqueeze(1)  # [G*n, 1]
        mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= qpos  # [G*n, ctx], causal with the cached prefix
        o = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask, scale=scale)
        out[rows] = o.reshape(num_heads, n, head_dim).transpose(0, 1)  # CUDA's SDPA may return other strides
    return out


def _over_dequantised_pages(q: torch.Tensor, cache: PagedKVCache, layer: int, meta: StepMetadata,
                            scale: float) -> torch.Tensor | None:
    """A step with prompt chunks over FP8 pages on the CPU: the decode rows read the pages in place (as in a
    step without prompts, the same bits), the prompt rows read their chunks' pages dequantised once
    (`dequantised_pages`, exact) where the kernel would convert every key once per tile of rows. None where
    the C kernel cannot (the caller runs the one call over the FP8 pages)."""
    kv = cache.layer(layer)
    d = meta.num_decode
    ids, table, lens, tiles = meta.prompt_pages(tile_rows(q.shape[1] // cache.geometry.num_kv_heads))
    k = dequantised_pages(kv.k, kv.k_scale, ids, q.dtype)
    v = dequantised_pages(kv.v, kv.v_scale, ids, q.dtype) if k is not None else None
    o = paged_decode_attention_cpu(q[d:], k, v, None, None, table, lens, scale, tiles=tiles) if v is not None else None
    if o is None or not d:
        return o
    out = paged_decode_attention_cpu(q[:d], kv.k, kv.v, kv.k_scale, kv.v_scale, meta.decode_page_table,
                                     meta.decode_context_lens, scale)
    return None if out is None else torch.cat([out, o])
