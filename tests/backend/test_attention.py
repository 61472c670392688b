"""Paged attention on the CPU against dense attention, prefill and decode rows in one step: the C kernel for the
whole step, and the torch path (pages gathered, SDPA) that hosts without the kernel run."""

from __future__ import annotations

import pytest
import torch

import backend.attention
from backend.attention import PrefillChunk, StepMetadata, paged_attention
from backend.config import ModelConfig
from backend.kv_cache import PagedKVCache
from kernels.cpu_paged_attention import available as c_kernel_available
from kernels.cpu_paged_attention import dequantises

PAGE = 16


def make_cache(kv_heads: int, head_dim: int, fmt: str, num_pages: int = 64) -> PagedKVCache:
    cfg = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8 * head_dim,
                                 "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 8,
                                 "num_key_value_heads": 8, "head_dim": head_dim, "max_position_embeddings": 4096})
    cfg = ModelConfig(**{**cfg.__dict__, "num_kv_heads": kv_heads})
    return PagedKVCache(cfg, fmt, num_pages, PAGE, torch.float32)


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """q [n, H, D] at positions start.., k/v [ctx, H_kv, D]: causal attention in float64."""
    n, heads, _ = q.shape
    group = heads // k.shape[1]
    k, v = k.double().repeat_interleave(group, dim=1), v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,khd->hnk", q.double(), k) * scale
    allowed = torch.arange(k.shape[0]).view(1, -1) <= (start + torch.arange(n)).view(-1, 1)
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hnk,khd->nhd", probs, v)


@pytest.fixture(params=["c_kernel", "torch"])
def kernel_calls(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> tuple[str, list[int]]:
    """Which path runs (the torch one: the C kernel reports it cannot run, as where it is not built) and the
    row counts of the C kernel's calls."""
    if request.param == "c_kernel" and not c_kernel_available():
        pytest.skip("the C paged attention kernel is not built here")
    kernel, dequantise, calls = backend.attention.paged_decode_attention_cpu, backend.attention.dequantised_pages, []

    def spy(q: torch.Tensor, *args, **kwargs) -> torch.Tensor | None:
        calls.append(q.shape[0])
        return kernel(q, *args, **kwargs) if request.param == "c_kernel" else None

    monkeypatch.setattr(backend.attention, "paged_decode_attention_cpu", spy)
    monkeypatch.setattr(backend.attention, "dequantised_pages",
                        lambda *args: dequantise(*args) if request.param == "c_kernel" else None)
    return request.param, calls


def expected_calls(path: str, fmt: str, decode: int, prompt: int, head_dim: int) -> list[int]:
    """Row counts of the C kernel's calls for a step: the whole step in one call, or over FP8 pages (where the
    kernel dequantises pages here) the prompt rows over their dequantised pages, then the decode rows; without
    the kernel, the decode rows try it and the chunks gather."""
    if path == "torch":
        return [decode + prompt, decode]
    if fmt == "fp8_e4m3" and dequantises(head_dim):
        return [prompt, decode]
    return [decode + prompt]


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp8_e4m3"])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("cached,new", [(0, 1), (0, 17), (15, 1), (16, 16), (17, 15), (100, 30)])
def test_prefill_chunk_and_decode_rows_match_dense_attention(fmt: str, group: int, cached: int, new: int,
                                                             kernel_calls: tuple[str, list[int]]) -> None:
    kv_heads, head_dim = 2, 32
    heads = kv_heads * group
    cache = make_cache(kv_heads, head_dim, fmt)
    perm = torch.randperm(cache.num_pages).tolist()  # pages out of order
    # sequence A: a prefill chunk after `cached` tokens; sequence B: one decode token at 40 tokens
    ctx_a, ctx_b = cached + new, 40
    pages_a, pages_b = perm[: -(-ctx_a // PAGE)], perm[20: 20 + -(-ctx_b // PAGE)]
    # magnitudes that differ per token (so do the FP8 exponents): mild on K, wide on V
    k_a = torch.randn(ctx_a, kv_heads, head_dim) * torch.logspace(-0.5, 0.5, ctx_a).view(-1, 1, 1)
    v_a = torch.randn(ctx_a, kv_heads, head_dim) * torch.logspace(-2, 2, ctx_a).view(-1, 1, 1)
    k_b, v_b = torch.randn(ctx_b, kv_heads, head_dim), torch.randn(ctx_b, kv_heads, head_dim) * 3

    def slots(pages: list[int], n: int) -> torch.Tensor:
        return torch.tensor([pages[i // PAGE] * PAGE + i % PAGE for i in range(n)])

    cache.store(0, slots(pages_a, ctx_a), k_a, v_a)
    cache.store(0, slots(pages_b, ctx_b), k_b, v_b)
    q = torch.randn(1 + new, heads, head_dim)  # row 0: B's decode token, rows 1..: A's chunk
    table_b = torch.tensor([pages_b])
    meta = StepMetadata(positions=torch.zeros(1 + new, dtype=torch.int64), slots=torch.zeros(1 + new, dtype=torch.int64),
                        num_decode=1, decode_page_table=table_b,
                        decode_context_lens=torch.tensor([ctx_b], dtype=torch.int32),
                        prefills=[PrefillChunk(1, new, ctx_a, torch.tensor([pages_a]))],
                        logits_rows=torch.tensor([0]), page_size=PAGE, mask_dtype=torch.float32)
    mask = torch.zeros(1, 1, 1, table_b.shape[1] * PAGE)
    mask[..., ctx_b:] = float("-inf")
    assert torch.equal(meta.decode_mask, mask)  # what the SDPA fallback takes, built from the lengths
    scale = head_dim ** -0.5
    out = paged_attention(q, cache, 0, meta, scale)
    path, calls = kernel_calls
    assert calls == expected_calls(path, fmt, 1, new, head_dim)

    # tight: against dense attention over what the cache holds (the dequantised values)
    held_a = cache.gather(0, torch.tensor([pages_a]))
    held_b = cache.gather(0, table_b)
    exp_a = dense_reference(q[1:], held_a[0][0, :ctx_a], held_a[1][0, :ctx_a], cached, scale)
    exp_b = dense_reference(q[:1], held_b[0][0, :ctx_b], held_b[1][0, :ctx_b], ctx_b - 1, scale)
    # float32 accumulation: absolute error scales with the largest value magnitude (V spans 1e-2..1e2)
    atol_a = 2e-6 * max(1.0, held_a[1].abs().max().item())
    torch.testing.assert_close(out[1:].double(), exp_a, atol=atol_a, rtol=1e-5)
    torch.testing.assert_close(out[:1].double(), exp_b, atol=2e-5, rtol=1e-5)
    # looser: what the cache holds against the original float32 values, mean error relative to the
    # mean output magnitude (bf16 rounds to 2^-9 relative, fp8 e4m3 to 2^-4; K errors also move the
    # softmax), over 64 query rows: one or two rows' mean has a heavy tail (up to 0.18 for fp8)
    tol = {"fp32": 1e-6, "bf16": 1e-2, "fp8_e4m3": 8e-2}[fmt]
    probe = torch.randn(64, heads, head_dim)
    orig_a = dense_reference(probe, k_a, v_a, ctx_a - 1, scale)
    held = dense_reference(probe, held_a[0][0, :ctx_a], held_a[1][0, :ctx_a], ctx_a - 1, scale)
    rel = (held - orig_a).abs().mean() / orig_a.abs().mean()
    assert rel.item() <= tol, rel.item()


@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3"])
def test_a_step_of_several_decode_rows_and_chunks(fmt: str, kernel_calls: tuple[str, list[int]]) -> None:
    """Two decode rows and two prompt chunks (one after a cached prefix) of different page counts in one step:
    each row against dense attention over its own sequence (the whole step's page table is zero-padded)."""
    kv_heads, heads, head_dim = 2, 6, 32
    cache = make_cache(kv_heads, head_dim, fmt)
    perm = torch.randperm(cache.num_pages).tolist()
    # (context after this step, rows this step): decode 70 and 9; chunks of 23 after 0 and of 12 after 40
    seqs = [(70, 1), (9, 1), (23, 23), (52, 12)]
    pages, at = [], 0
    for ctx, _ in seqs:
        pages.append(perm[at: at + -(-ctx // PAGE)])
        at += len(pages[-1])
    held = []
    for (ctx, _), pg in zip(seqs, pages):
        k, v = torch.randn(ctx, kv_heads, head_dim), torch.randn(ctx, kv_heads, head_dim) * 2
        cache.store(0, torch.tensor([pg[i // PAGE] * PAGE + i % PAGE for i in range(ctx)]), k, v)
        k_held, v_held = cache.gather(0, torch.tensor([pg]))
        held.append((k_held[0, :ctx], v_held[0, :ctx]))
    rows = sum(n for _, n in seqs)
    q = torch.randn(rows, heads, head_dim)
    width = max(len(p) for p in pages[:2])
    table = torch.tensor([p + [0] * (width - len(p)) for p in pages[:2]])
    lens = torch.tensor([seqs[0][0], seqs[1][0]], dtype=torch.int32)
    meta = StepMetadata(positions=torch.zeros(rows, dtype=torch.int64), slots=torch.zeros(rows, dtype=torch.int64),
                        num_decode=2, decode_page_table=table, decode_context_lens=lens,
                        prefills=[PrefillChunk(2, 23, 23, torch.tensor([pages[2]])),
                                  PrefillChunk(25, 12, 52, torch.tensor([pages[3]]))],
                        logits_rows=torch.tensor([0, 1]), page_size=PAGE, mask_dtype=torch.float32)
    scale = head_dim ** -0.5
    out = paged_attention(q, cache, 0, meta, scale)
    assert kernel_calls[1] == expected_calls(kernel_calls[0], fmt, 2, rows - 2, head_dim)
    start = 0
    for (ctx, n), (k, v) in zip(seqs, held):
        exp = dense_reference(q[start: start + n], k, v, ctx - n, scale)
        torch.testing.assert_close(out[start: start + n].double(), exp, atol=2e-5, rtol=1e-5)
        start += n
