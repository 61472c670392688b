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

Prefill (per chunk): the chunk's K/V are already stored, so the keys are the
sequence's first `context_len` slots (cached prefix + this chunk); query i sits
at position `start + i` and sees keys 0..start+i (causal with an offset). GQA the
same way: the G query heads of a KV head are stacked into G*n query rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from backend.kv_cache import PagedKVCache
from kernels.cpu_paged_attention import paged_decode_attention_cpu

__all__ = ["PrefillChunk", "StepMetadata", "paged_attention"]


@dataclass
class PrefillChunk:
    """One sequence's prompt chunk inside the flat batch."""

    token_start: int  # first row of this chunk in the flat batch
    num_tokens: int
    context_len: int  # tokens in the cache after this chunk (prefix + chunk)
    page_table: torch.Tensor  # [1, P] int64, pages covering context_len


@dataclass
class StepMetadata:
    """Everything the layers need to know about the step's batch."""

    positions: torch.Tensor  # [T] int64
    slots: torch.Tensor  # [T] int64, where each token's K/V is written
    num_decode: int  # decode rows: rows 0..num_decode-1 of the flat batch, prompt chunks after them
    decode_page_table: torch.Tensor | None  # [D, P] int64 (padded with page 0)
    decode_mask: torch.Tensor | None  # [D, 1, 1, P*PAGE_SIZE] additive (0 or -inf), compute dtype
    decode_context_lens: torch.Tensor | None  # [D] int32, keys each decoding sequence attends to
    prefills: list[PrefillChunk]
    logits_rows: torch.Tensor  # [R] int64, rows whose logits are sampled: the decode rows first, in order (then any scored prompt rows)


def paged_attention(q: torch.Tensor, cache: PagedKVCache, layer: int, meta: StepMetadata,
                    scale: float) -> torch.Tensor:
    """Attention output [T, heads, head_dim] for queries q [T, heads, head_dim]."""
    t, num_heads, head_dim = q.shape
    num_kv_heads = cache.geometry.num_kv_heads
    group = num_heads // num_kv_heads
    d = meta.num_decode
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
        out[rows] = o.view(num_heads, n, head_dim).transpose(0, 1)
    return out
