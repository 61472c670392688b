"""Zero rows that round a step's bfloat16 GEMMs to a multiple of the granule (`backend/gemm_rows.py`):
the GEMMs see the rounded row count, and the step's logits and stored K/V are those of the unpadded step
up to the GEMMs' summation order."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backend import gemm_rows
from backend.engine import EngineConfig, LLMEngine
from backend.gemm_widen import widening_pays
from backend.linear import Linear
from backend.sampling_params import SamplingParams
from tests.backend.engine_spy import record_sampled_logits
from tests.backend.tiny_models import write_tiny_model

PROMPT_ROWS = 203  # more than any CPU's C GEMV takes (128 at most), 5 short of a multiple of 16
# bf16 logits of the same step at two GEMM row counts: equal on an AMX Xeon (oneDNN may sum in another order
# at another M); |logits| <= 0.75, and the pad rows put before the step's rows instead moved them by 0.7
LOGITS_ATOL = 0.05
VOCAB = 320  # the tiny model's


@pytest.fixture
def no_widening(monkeypatch: pytest.MonkeyPatch):
    """bfloat16 GEMMs on torch's bfloat16 path on every host (hosts without BF16 units widen them)."""
    monkeypatch.setenv("EDGESERVE_BF16_WIDEN", "0")
    widening_pays.cache_clear()
    yield
    widening_pays.cache_clear()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("gemm_rows") / "m", "qwen2", seed=5)  # q/k/v biases


def _gemm_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Row counts of every unpacked GEMM the decoder layers' `Linear`s run from now on (not the LM head's:
    its rows are the logits rows)."""
    seen: list[int] = []
    dense = Linear._dense

    def spy(self: Linear, x: torch.Tensor) -> torch.Tensor:
        if self.out_features != VOCAB:
            seen.append(x.shape[0])
        return dense(self, x)

    monkeypatch.setattr(Linear, "_dense", spy)
    return seen


@pytest.mark.parametrize("granule, rows, pad", [(16, 203, 5), (16, 208, 0), (8, 1, 7), (1, 203, 0)])
def test_pad_rows_rounds_up_to_the_granule(monkeypatch: pytest.MonkeyPatch, granule: int, rows: int,
                                           pad: int) -> None:
    monkeypatch.setenv("EDGESERVE_GEMM_ROW_GRANULE", str(granule))
    assert gemm_rows.pad_rows(rows) == pad


def test_only_bfloat16_gemms_past_the_gemv_build_per_rows(no_widening) -> None:
    w = torch.randn(64, 48)
    bf16 = Linear(w.to(torch.bfloat16))
    assert gemm_rows.builds_per_rows(bf16, PROMPT_ROWS)
    assert not gemm_rows.builds_per_rows(Linear(w), PROMPT_ROWS)  # float32: MKL, nothing built per shape
    assert not gemm_rows.builds_per_rows(object(), PROMPT_ROWS)
    if bf16.gemv_rows:  # the C GEMV's rows go nowhere near oneDNN
        assert not gemm_rows.builds_per_rows(bf16, bf16.gemv_rows)


def _prefill(engine: LLMEngine, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of every prompt row, computed as one prefill step, and the K/V that step stored."""
    seq = engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0.0))
    batch = engine.scheduler.schedule()
    assert batch.prefill and batch.prefill[0][1] == len(ids)
    input_ids, meta = engine.runner.prepare(batch)
    meta.logits_rows = torch.arange(len(ids))
    logits = engine.model.forward(input_ids, meta, engine.cache)
    kv = torch.stack([torch.stack(engine.cache.read_tokens(layer, meta.slots))
                      for layer in range(engine.model.cfg.num_layers)])
    engine.scheduler.finish(seq, "stop")
    return logits, kv


def test_a_padded_prefill_gives_the_unpadded_logits_and_kv(tiny_dir: Path, no_widening,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    engine = LLMEngine.from_pretrained(tiny_dir, EngineConfig(dtype="bfloat16", kv_format="bf16",
                                                              kv_cache_bytes=8 * 2**20, page_size=16,
                                                              max_num_batched_tokens=256, prefill_chunk_size=256))
    ids = torch.randint(3, 320, (PROMPT_ROWS,), generator=torch.Generator().manual_seed(1)).tolist()
    seen = _gemm_rows(monkeypatch)
    monkeypatch.setenv("EDGESERVE_GEMM_ROW_GRANULE", "1")
    plain, plain_kv = _prefill(engine, ids)
    assert set(seen) == {PROMPT_ROWS}
    seen.clear()
    monkeypatch.setenv("EDGESERVE_GEMM_ROW_GRANULE", "16")
    padded, padded_kv = _prefill(engine, ids)
    assert set(seen) == {208}  # every layer's GEMMs ran the rounded rows
    assert padded.shape == plain.shape == (PROMPT_ROWS, 320)
    assert (padded - plain).abs().max().item() <= LOGITS_ATOL
    assert (padded.argmax(-1) == plain.argmax(-1)).float().mean().item() >= 0.95
    torch.testing.assert_close(padded_kv.float(), plain_kv.float(), atol=0.05, rtol=0.02)


def test_a_mixed_step_pads_after_its_decode_rows(tiny_dir: Path, no_widening, monkeypatch: pytest.MonkeyPatch
                                                 ) -> None:
    """A request decoding while a long prompt prefills in the same steps: its sampled logits and the
    prompt's first token's logits are those of the unpadded steps."""
    rows = _gemm_rows(monkeypatch)

    def run(granule: str) -> tuple[dict[str, list[torch.Tensor]], list[int]]:
        monkeypatch.setenv("EDGESERVE_GEMM_ROW_GRANULE", granule)
        engine = LLMEngine.from_pretrained(tiny_dir, EngineConfig(
            dtype="bfloat16", kv_format="bf16", kv_cache_bytes=8 * 2**20, page_size=16, max_num_seqs=4,
            max_num_batched_tokens=256, prefill_chunk_size=256, mixed_step_tokens=256))
        seen_logits = record_sampled_logits(engine)
        engine.add_request([7, 8, 9, 10], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                           request_id="decoding")
        engine.step()  # its prompt alone
        rows.clear()
        long = torch.randint(3, 320, (PROMPT_ROWS - 1,), generator=torch.Generator().manual_seed(2)).tolist()
        engine.add_request(long, SamplingParams(max_tokens=1, temperature=0.0), request_id="long")
        while engine.has_work():
            engine.step()
        return seen_logits, list(rows)

    plain, plain_rows = run("1")
    padded, padded_rows = run("16")
    assert PROMPT_ROWS in plain_rows and 208 in padded_rows and PROMPT_ROWS not in padded_rows  # 1 decode + 202
    for rid in ("decoding", "long"):
        assert len(padded[rid]) == len(plain[rid])
        for a, b in zip(padded[rid], plain[rid]):
            assert (a - b).abs().max().item() <= LOGITS_ATOL
