"""MLA decode attention: the Triton kernel against the torch reference, and the reference against
plain (non-paged) softmax attention.

Tolerances, relative to the largest |c_kv| value (outputs are convex mixes of c_kv rows):
- float32 queries: 2e-5. Both dots run in IEEE float32 (the interpreter always, CUDA with
  input_precision="ieee"); only the summation order and exp2 against exp differ.
- bfloat16 queries under the interpreter: the dots still run in float32, so the only gap is the
  output's cast to bfloat16, which the interpreter truncates where torch rounds: one bf16 step
  (2**-7 relative) plus the float32 allowance.
- bfloat16 queries on CUDA: dots in bfloat16 with float32 accumulation, fp8 latents dequantised
  and then rounded to bfloat16, probabilities rounded to bfloat16: 2**-6.
"""

from __future__ import annotations

import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: CPU runs interpret the kernels

import pytest
import torch

triton = pytest.importorskip("triton")
pytest.importorskip("numpy")  # the interpreter is numpy-backed

from backend.errors import InvalidRequest  # noqa: E402
from kernels.latent_kv_store import (LATENT_FORMATS, dequantize_latent_ref, latent_row_dtype,  # noqa: E402
                                     latent_row_elems, quantize_latent_ref, store_latent_ref)
from kernels.mla_decode import mla_decode_attention, mla_decode_ref  # noqa: E402

INTERPRET = triton.knobs.runtime.interpret
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="CPU runs need TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
        INTERPRET or not torch.cuda.is_available(), reason="needs a CUDA device and TRITON_INTERPRET=0")]),
]
ROPE_DIM = 16
PAGE_SIZE = 8
SHARED_PAGES = 2  # the last sequence shares its first pages (a cached prefix) with the one before it


@pytest.fixture
def seed() -> int:
    """Fresh inputs each run; the seed is in failure messages to replay one."""
    value = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(value)
    return value


class Case:
    """Sequences of random latent rows stored in shuffled pages; every slot not written is NaN."""

    def __init__(self, context_lens: list[int], kv_lora_rank: int, kv_format: str, device: str,
                 page_size: int = PAGE_SIZE, rope_dim: int = ROPE_DIM) -> None:
        self.kv_lora_rank, self.kv_format, self.rope_dim = kv_lora_rank, kv_format, rope_dim
        pages_per_seq = [triton.cdiv(n, page_size) for n in context_lens]
        width = max(pages_per_seq) + 1  # one table entry past every sequence's end: never read
        num_pages = sum(pages_per_seq) + 3
        ids = torch.randperm(num_pages)
        self.page_table = torch.full((len(context_lens), width), int(ids[-1]), dtype=torch.int32)
        self.latents: list[torch.Tensor] = []
        self.k_pes: list[torch.Tensor] = []
        row_elems = latent_row_elems(kv_lora_rank, rope_dim, kv_format)
        # NaN everywhere (0xFF bytes are NaN in e4m3, float32 and bfloat16), so a stray read shows
        self.pages = torch.full((num_pages, page_size, row_elems), 0xFF, dtype=torch.uint8)
        if kv_format != "fp8_e4m3":
            self.pages = torch.full((num_pages, page_size, row_elems), float("nan"),
                                    dtype=latent_row_dtype(kv_format))
        next_page = 0
        for d, (n, used) in enumerate(zip(context_lens, pages_per_seq)):
            # each token's latent scaled by 2**U(-2, 2): fp8 group scales differ between tokens
            latent = torch.randn(n, kv_lora_rank) * torch.exp2(torch.empty(n, 1).uniform_(-2, 2))
            k_pe = torch.randn(n, rope_dim)
            self.page_table[d, :used] = ids[next_page:next_page + used]
            first_own = 0
            if d == len(context_lens) - 1 and d > 0 and min(used, pages_per_seq[d - 1]) > SHARED_PAGES:
                self.page_table[d, :SHARED_PAGES] = self.page_table[d - 1, :SHARED_PAGES]
                first_own = SHARED_PAGES * page_size
                latent[:first_own] = self.latents[d - 1][:first_own]
                k_pe[:first_own] = self.k_pes[d - 1][:first_own]
            next_page += used
            positions = torch.arange(first_own, n)
            slots = self.page_table[d, positions // page_size].long() * page_size + positions % page_size
            store_latent_ref(latent[first_own:], k_pe[first_own:], self.pages, slots, kv_format)
            self.latents.append(latent)
            self.k_pes.append(k_pe)
        self.context_lens = torch.tensor(context_lens, dtype=torch.int32)
        self.pages, self.page_table = self.pages.to(device), self.page_table.to(device)
        self.context_lens = self.context_lens.to(device)

    def args(self, q_latent: torch.Tensor, q_pe: torch.Tensor, scale: float) -> tuple:
        return (q_latent, q_pe, self.pages, self.kv_format, self.kv_lora_rank, self.rope_dim, self.page_table,
                self.context_lens, scale)


def tolerance(q_dtype: torch.dtype, device: str, value_scale: float) -> float:
    """Max abs difference allowed between kernel and reference (see the module docstring)."""
    if q_dtype == torch.float32:
        return 2e-5 * value_scale
    return (2.0 ** -7 + 2e-5 if device == "cpu" else 2.0 ** -6) * value_scale


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_format", LATENT_FORMATS)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_lora_rank,num_heads", [(32, 20), (136, 3)])
def test_kernel_matches_reference(device: str, kv_format: str, q_dtype: torch.dtype, kv_lora_rank: int,
                                  num_heads: int, seed: int) -> None:
    # lengths: 1, a non-multiple of the page size, several 32-token tiles (so several splits), and a
    # sequence sharing its first pages with the one before
    case = Case([1, 13, 70, 45], kv_lora_rank, kv_format, device)
    batch = len(case.latents)
    q_latent = torch.randn(batch, num_heads, kv_lora_rank, device=device).to(q_dtype)
    q_pe = torch.randn(batch, num_heads, ROPE_DIM, device=device).to(q_dtype)
    scale = 2.0 / math.sqrt(kv_lora_rank + ROPE_DIM)  # sharper than uniform attention
    want = mla_decode_ref(*case.args(q_latent, q_pe, scale))
    assert not bool(want.isnan().any())
    value_scale = max(float(x.abs().max()) for x in case.latents)
    for num_kv_splits in (1, 4, 7):  # 7: more partitions than a short sequence has tiles (empty ones)
        got = mla_decode_attention(*case.args(q_latent, q_pe, scale), num_kv_splits=num_kv_splits)
        assert got.dtype == q_dtype and got.shape == want.shape
        diff = float((got.float() - want.float()).abs().max())
        assert diff <= tolerance(q_dtype, device, value_scale), \
            f"seed {seed}: splits {num_kv_splits}, max abs diff {diff:.3g} (values up to {value_scale:.3g})"


@pytest.mark.cuda
@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs a CUDA device and TRITON_INTERPRET=0")
@pytest.mark.parametrize("kv_format", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("num_heads", [16, 128])
def test_kernel_matches_reference_at_model_shape(kv_format: str, num_heads: int, seed: int) -> None:
    # Kimi K2.x / DeepSeek-V3 rows (R 512, Dr 64), 16-token pages, lengths around tile and page edges
    case = Case([1, 17, 1025, 3000, 4096], 512, kv_format, "cuda", page_size=16, rope_dim=64)
    q_latent = torch.randn(len(case.latents), num_heads, 512, device="cuda", dtype=torch.bfloat16)
    q_pe = torch.randn(len(case.latents), num_heads, 64, device="cuda", dtype=torch.bfloat16)
    scale = 192 ** -0.5  # 1/sqrt(qk_nope_head_dim + qk_rope_head_dim)
    want = mla_decode_ref(*case.args(q_latent, q_pe, scale))
    value_scale = max(float(x.abs().max()) for x in case.latents)
    for num_kv_splits in (1, 8, 32):
        got = mla_decode_attention(*case.args(q_latent, q_pe, scale), num_kv_splits=num_kv_splits)
        diff = float((got.float() - want.float()).abs().max())
        assert diff <= tolerance(torch.bfloat16, "cuda", value_scale), \
            f"seed {seed}: splits {num_kv_splits}, max abs diff {diff:.3g} (values up to {value_scale:.3g})"


@pytest.mark.parametrize("kv_format", LATENT_FORMATS)
def test_reference_is_plain_attention_over_dequantised_rows(kv_format: str, seed: int) -> None:
    kv_lora_rank, num_heads = 136, 3
    case = Case([1, 13, 40, 29], kv_lora_rank, kv_format, "cpu")
    batch = len(case.latents)
    q_latent = torch.randn(batch, num_heads, kv_lora_rank)
    q_pe = torch.randn(batch, num_heads, ROPE_DIM)
    scale = 1.5 / math.sqrt(kv_lora_rank + ROPE_DIM)
    got = mla_decode_ref(*case.args(q_latent, q_pe, scale))
    for d in range(batch):
        # the rows the store would write for this sequence, dequantised, without any paging
        rows = quantize_latent_ref(case.latents[d], case.k_pes[d], kv_format)
        c_kv, k_pe = dequantize_latent_ref(rows, kv_lora_rank, ROPE_DIM, kv_format, torch.float32)
        query = torch.cat([q_latent[d], q_pe[d]], dim=-1).unsqueeze(1)  # [H, 1, R + Dr]
        key = torch.cat([c_kv, k_pe], dim=-1).expand(num_heads, -1, -1)  # one latent head for all H
        want = torch.nn.functional.scaled_dot_product_attention(query, key, c_kv.expand(num_heads, -1, -1),
                                                                 scale=scale).squeeze(1)
        torch.testing.assert_close(got[d], want, rtol=1e-5, atol=1e-5, msg=f"seed {seed}: sequence {d}")


def test_rejects_mismatched_arguments() -> None:
    case = Case([5, 9], 32, "fp8_e4m3", "cpu")
    q_latent, q_pe = torch.randn(2, 4, 32), torch.randn(2, 4, ROPE_DIM)
    args = list(case.args(q_latent, q_pe, 0.1))
    with pytest.raises(InvalidRequest, match="pages must be"):
        mla_decode_attention(*args[:3], "bf16", *args[4:])
    with pytest.raises(InvalidRequest, match="page_table"):
        mla_decode_attention(*args[:6], case.page_table.long(), *args[7:])
    with pytest.raises(InvalidRequest, match="q_latent, q_pe"):
        mla_decode_attention(q_latent, torch.randn(2, 4, 8), *args[2:])
    with pytest.raises(InvalidRequest, match="num_kv_splits"):
        mla_decode_attention(*args, num_kv_splits=0)
