"""The pool is sized from the byte budget and admission uses it: FP8 holds ~2x the tokens of BF16."""

from __future__ import annotations

import pytest

from backend.config import ModelConfig
from backend.kv_cache import kv_bytes_per_token, pages_for_budget
from backend.page_allocator import PageAllocator
from backend.sampling_params import SamplingParams
from backend.scheduler import Scheduler, SchedulerConfig
from backend.sequence import Sequence, SequenceStatus

# SmolLM2-135M's geometry (30 layers, 3 KV heads of 64): the byte maths needs no weights
SMOLLM2 = ModelConfig.from_dict({
    "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "max_position_embeddings": 8192})
PAGE = 16
PROMPT, OUTPUT = 512, 256


def test_bytes_per_token_and_the_exact_capacity_ratio() -> None:
    bf16 = kv_bytes_per_token(SMOLLM2, "bf16")
    fp8 = kv_bytes_per_token(SMOLLM2, "fp8_e4m3")
    assert bf16 == 30 * 2 * 3 * 64 * 2 == 23040
    assert fp8 == 30 * 2 * 3 * (64 + 1) == 11700  # one int8 exponent per (token, head)
    assert bf16 / fp8 == pytest.approx(1.969, abs=1e-3)


def admitted(kv_format: str, budget: int, offered: int) -> tuple[int, int]:
    """Offer `offered` requests of 512 + 256 tokens at once; return (admitted, waiting)."""
    pages = pages_for_budget(SMOLLM2, kv_format, budget, PAGE)
    sched = Scheduler(SchedulerConfig(max_model_len=8192, max_num_seqs=256, max_num_batched_tokens=10**6,
                                      prefill_chunk_size=PROMPT, max_waiting=1000), PageAllocator(pages), PAGE)
    seqs = [Sequence(str(i), [5] * PROMPT, SamplingParams(max_tokens=OUTPUT)) for i in range(offered)]
    for s in seqs:
        sched.add(s)
    sched.schedule()
    running = sum(s.status is SequenceStatus.RUNNING for s in seqs)
    return running, sched.num_waiting


def test_one_budget_admits_32_in_bf16_and_64_in_fp8() -> None:
    per_request_pages = (PROMPT + OUTPUT) // PAGE  # 48
    # just under what 33 BF16 requests need
    budget = 33 * per_request_pages * PAGE * kv_bytes_per_token(SMOLLM2, "bf16") - 1
    assert admitted("bf16", budget, 40) == (32, 8)  # the 33rd waits
    assert admitted("fp8_e4m3", budget, 70) == (64, 6)  # twice as many, the 65th waits
