"""The LM head's 8-bit copy (`backend/lm_head.py`): its rounding, its product through the INT4 kernel as two
nibble planes against a direct reference on fresh random inputs, the choice by rows, an engine that serves with
it (steps of few logits rows on the copy, larger ones exactly as without it), and a tensor-parallel group whose
ranks each run their shard's copy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backend.engine import EngineConfig, LLMEngine
from backend.errors import WeightsError
from backend.linear import Linear
from backend.lm_head import Int8Head, int8_head, quantize_rows_int8
from backend.sampling_params import SamplingParams
from kernels import cpu_gemv_int4
from tests.backend.engine_spy import record_sampled_logits
from tests.backend.tiny_models import write_tiny_model

needs_kernel = pytest.mark.skipif(not cpu_gemv_int4.available(),
                                  reason=f"the INT4 C kernel does not build here: {cpu_gemv_int4.build_error()}")


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    row_scale = torch.exp(torch.randn(n, 1, generator=g) * 2)  # rows of very different ranges
    w = torch.randn(n, k, generator=g) * row_scale
    w[0] = 0.0  # an all-zero row: scale 0, codes 0
    return w.to(torch.bfloat16)


def test_rows_round_to_within_half_their_scale() -> None:
    w = _weight(64, 96, seed=1)
    q, s = quantize_rows_int8(w)
    assert q.dtype == torch.int8 and s.dtype == torch.bfloat16 and s.shape == (64,)
    assert int(q.abs().max()) <= 127 and int(q[0].abs().max()) == 0 and float(s[0]) == 0.0
    err = (w.float() - s.float()[:, None] * q.float()).abs()
    # s was rounded to bfloat16, so a row's largest weight may sit a quarter step past code 127 (clamped)
    assert bool((err <= 0.5 * s.float()[:, None] * (1 + 2 ** -6)).all())
    assert bool((q.abs().amax(dim=1)[1:] >= 126).all())  # every row uses its range


@needs_kernel
@pytest.mark.parametrize(("n", "k"), [(37, 96), (100, 40), (48, 576), (33, 640)])
def test_the_copy_computes_x_times_its_rounded_weight(n: int, k: int) -> None:
    """Two nibble planes in one INT4 call give x (s q)^T: float32 sums of exact products, one bfloat16 rounding."""
    w = _weight(n, k, seed=n + k)
    head = Int8Head(Linear(w), max_rows=8)
    q, s = quantize_rows_int8(w)
    w8 = s.float()[:, None] * q.float()
    for m in (1, 2, 3, 8, 11):
        x = torch.randn(m, k).to(torch.bfloat16)
        want = x.float() @ w8.T
        got = head.int8(x)
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        # bfloat16 rounding of y (2^-9 relative) plus float32 sums beside a cancelled 128 s X term
        tol = 2 ** -8 * want.abs() + 1e-5 * (x.float().abs() @ (128 * s.float()[:, None].expand(n, k)).T) + 1e-30
        assert bool(((got.float() - want).abs() <= tol).all()), (m, float((got.float() - want).abs().max()))
        assert not torch.equal(got, Linear(w)(x))  # the copy, not the dense head


@needs_kernel
def test_calls_of_more_rows_than_max_rows_run_the_dense_head() -> None:
    w = _weight(80, 64, seed=3)
    dense = Linear(w)
    head = Int8Head(dense, max_rows=2)
    for m in (1, 2):
        x = torch.randn(m, 64).to(torch.bfloat16)
        assert torch.equal(head(x), head.int8(x))
        assert head.read_bytes(m) == head.panels.nbytes < dense.nbytes
    x = torch.randn(3, 64).to(torch.bfloat16)
    assert torch.equal(head(x), dense(x)) and head.read_bytes(3) == dense.nbytes
    assert head.pack_bytes == dense.pack_bytes + head.panels.nbytes
    never = Int8Head(dense, max_rows=0)  # never the faster: nothing more held
    assert never.panels is None and never.pack_bytes == dense.pack_bytes and torch.equal(never(x[:1]), dense(x[:1]))


def test_where_it_cannot_run_the_head_stays_dense() -> None:
    dense = Linear(_weight(16, 12, seed=4))  # hidden size not a multiple of 8
    assert int8_head(dense) is dense
    with pytest.raises(ValueError, match="multiple of 8"):
        Int8Head(dense, max_rows=1)
    assert int8_head(Linear(_weight(16, 64, seed=5)), device="cuda").__class__ is Linear


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("lmhead") / "m", "llama", seed=7)


def _run(engine: LLMEngine, prompts: list[list[int]]) -> tuple[dict[str, list[torch.Tensor]], list[list[int]]]:
    seen = record_sampled_logits(engine)
    seqs = [engine.add_request(p, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), request_id=str(i))
            for i, p in enumerate(prompts)]
    while engine.has_work():
        engine.step()
    return seen, [s.output_ids for s in seqs]


@needs_kernel
def test_an_engine_serves_few_rows_on_the_copy_and_more_as_before(tiny_dir: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGESERVE_INT8_HEAD_ROWS", "2")
    cfg = dict(dtype="bfloat16", kv_format="bf16", kv_cache_bytes=2**20, max_num_seqs=4, max_num_batched_tokens=64)
    dense = LLMEngine.from_pretrained(tiny_dir, EngineConfig(**cfg))
    eight = LLMEngine.from_pretrained(tiny_dir, EngineConfig(lm_head_weights="int8", **cfg))
    head = eight.model.lm_head
    assert isinstance(head, Int8Head) and head.max_rows == 2
    assert eight.model.weight_memory()["packs"] - dense.model.weight_memory()["packs"] == head.panels.nbytes
    saved = head.nbytes - head.panels.nbytes  # what a step of up to max_rows rows reads less
    assert dense.model.decode_bytes(1) - eight.model.decode_bytes(1) == saved > 0
    assert eight.model.decode_bytes(3) == dense.model.decode_bytes(3) == dense.model.weight_bytes
    prompts = [[(5 * i + 3 * j) % 200 + 4 for j in range(9)] for i in range(3)]
    # one request: every step has one logits row, so every logit comes from the copy: close, not equal
    a, _ = _run(dense, prompts[:1])
    b, _ = _run(eight, prompts[:1])
    first_a, first_b = a["0"][0], b["0"][0]  # the prompt's step: the same hidden state before the head
    assert not torch.equal(first_a, first_b)
    assert float((first_a - first_b).abs().max()) <= 0.05 * float(first_a.abs().max())
    # three at once: three logits rows a step, past max_rows: the dense head, the same logits and tokens
    a3, tokens_a = _run(dense, prompts)
    b3, tokens_b = _run(eight, prompts)
    assert tokens_a == tokens_b
    assert all(torch.equal(x, y) for rid in a3 for x, y in zip(a3[rid], b3[rid], strict=True))


def test_an_unknown_head_format_is_refused(tiny_dir: Path) -> None:
    with pytest.raises(WeightsError, match="LM head"):
        LLMEngine.from_pretrained(tiny_dir, EngineConfig(lm_head_weights="int4", kv_cache_bytes=2**20))


@needs_kernel
def test_each_tensor_parallel_rank_runs_its_shard_of_the_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TP 2: the flag reaches the follower, so both ranks' vocabulary columns come from their shard's copy. The
    hidden state before the head is bit for bit the dense group's at each request's first token, so a rank whose
    head stayed dense would give its columns bit-equal to the dense group's."""
    from backend.config import load_config
    from backend.distributed.sharding import ShardPlan
    from tests.backend.test_tp import generate, prompts_for

    monkeypatch.setenv("EDGESERVE_INT8_HEAD_ROWS", "8")  # inherited by the spawned rank
    path = write_tiny_model(tmp_path / "m", "llama", seed=7, num_attention_heads=8, num_key_value_heads=2)
    vocab = load_config(path).vocab_size
    shard = ShardPlan(load_config(path), 0, 2).vocab_shard_size
    prompts = prompts_for(vocab)
    dense = generate(path, 2, prompts)
    eight = generate(path, 2, prompts, lm_head_weights="int8")
    for a, b in zip(dense.logits, eight.logits, strict=True):
        first_a, first_b = a[0], b[0]
        for cols in (slice(0, shard), slice(shard, vocab)):  # rank 0's columns, rank 1's
            assert not torch.equal(first_a[cols], first_b[cols])
        assert float((first_a - first_b).abs().max()) <= 0.05 * float(first_a.abs().max())
