"""Per-phase weights in mixed steps: decode rows run on the decode weights whatever shares their step.

A seeded request is decoded twice on a unified engine with FP32 prefill and INT4 decode
weights: alone, and while other prompts are being prefilled in the same steps (chunks
small enough that every one of its decode steps is mixed). Its tokens and the logits it
sampled from must be the same. Had its decode rows run on the prefill weights in mixed
steps, its logits would carry the FP32-vs-INT4 difference (measured in the test, so that
it is known to show) and, with this seed, its 6th token would differ.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backend.engine import EngineConfig, LLMEngine
from backend.linear import Int4Linear, Linear
from backend.sampling_params import SamplingParams
from tests.backend.engine_spy import record_sampled_logits
from tests.backend.tiny_models import write_tiny_model

# hidden 96, heads 6 x 16, intermediate 128: every K is a multiple of the INT4 group of 32
CFG = dict(dtype="float32", kv_format="fp32", kv_cache_bytes=2**20, max_num_seqs=5, max_num_batched_tokens=12,
           prefill_chunk_size=8)
PROMPT = [5, 9, 17, 33, 65, 129, 250, 3]
HOT = SamplingParams(max_tokens=12, temperature=0.7, seed=38, ignore_eos=True)
# 160 prompt tokens at 11 a step: the first completes (an LM-head row of its own) in the probe's
# last decode steps, and with max_tokens=1 no other request ever decodes beside the probe
OTHERS = [[(7 * i + j) % 300 + 10 for j in range(80)] for i in range(2)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("phase") / "m", "llama", seed=21)


def _engine(path: Path, prefill: str, decode: str) -> LLMEngine:
    return LLMEngine.from_pretrained(path, EngineConfig(prefill_weights=prefill, decode_weights=decode,
                                                        int4_group_size=32, **CFG))


def _decode(engine: LLMEngine, beside_prefills: bool) -> tuple[list[int], list[torch.Tensor], int]:
    """The request's tokens, the logits it sampled them from, and how many of its decode steps
    were mixed; with `beside_prefills`, other prompts are queued once its own prompt is done,
    so they prefill while it decodes."""
    seen = record_sampled_logits(engine)
    seq = engine.add_request(PROMPT, HOT, request_id="probe")
    engine.step()  # its whole prompt: the first token
    if beside_prefills:
        for i, ids in enumerate(OTHERS):
            engine.add_request(ids, SamplingParams(max_tokens=1, temperature=1.0, seed=i, ignore_eos=True))
    mixed = 0
    while seq.finish_reason is None:
        before = engine.model.steps_by_phase["mixed"]
        engine.step()
        mixed += engine.model.steps_by_phase["mixed"] - before
    while engine.has_work():
        engine.step()
    return seq.output_ids, seen["probe"], mixed


def test_decode_rows_keep_the_decode_weights_beside_prefills(tiny_dir: Path) -> None:
    alone_tokens, alone_logits, _ = _decode(_engine(tiny_dir, "fp32", "int4"), beside_prefills=False)
    mixed_tokens, mixed_logits, mixed_steps = _decode(_engine(tiny_dir, "fp32", "int4"), beside_prefills=True)
    assert mixed_steps == len(alone_tokens) - 1  # every one of its decode steps had prompt rows beside it
    _, fp32_logits, _ = _decode(_engine(tiny_dir, "fp32", "fp32"), beside_prefills=False)
    # the size of what a decode row on the prefill weights would see: INT4 vs FP32
    weight_gap = max((a - b).abs().max().item() for a, b in zip(alone_logits[1:], fp32_logits[1:]))
    assert weight_gap > 1e-3
    assert mixed_tokens == alone_tokens
    # distinct formats: decode rows never share a GEMM with prompt rows, every other op is
    # row-wise, so the logits are the very same bits
    for a, b in zip(alone_logits, mixed_logits, strict=True):
        assert torch.equal(a, b)


def test_one_format_runs_each_gemm_once_over_all_rows(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Equal formats (one copy) pay nothing for the split: a mixed step calls each linear once.
    Decode and prompt rows share the GEMMs, so the request's logits match the alone run up
    to float batch-invariance (GEMM summation order varies with the row count), not bit for bit."""
    alone = _engine(tiny_dir, "fp32", "fp32")
    engine = _engine(tiny_dir, "fp32", "fp32")
    for e in (alone, engine):  # the Python layers' GEMMs are under test (fused steps call none of them)
        e.model.fused_decode = False
    alone_tokens, alone_logits, _ = _decode(alone, beside_prefills=False)
    calls = {"n": 0}
    dense_call = Linear.__call__

    def spy(self: Linear, x: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        return dense_call(self, x)

    monkeypatch.setattr(Linear, "__call__", spy)
    mixed_tokens, mixed_logits, mixed_steps = _decode(engine, beside_prefills=True)
    linears = 4 * engine.model.cfg.num_layers + 1  # qkv, o, gate_up, down per layer; the LM head
    assert calls["n"] == linears * sum(engine.model.steps_by_phase.values())
    assert mixed_steps == len(alone_tokens) - 1
    assert mixed_tokens == alone_tokens
    for a, b in zip(alone_logits, mixed_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_a_mixed_step_runs_decode_rows_on_int4_and_prompt_rows_on_fp32(tiny_dir: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _engine(tiny_dir, "fp32", "int4")
    rows: dict[str, list[int]] = {"int4": [], "dense": []}
    int4_call, dense_call = Int4Linear.__call__, Linear.__call__

    def int4_spy(self: Int4Linear, x: torch.Tensor) -> torch.Tensor:
        rows["int4"].append(x.shape[0])
        return int4_call(self, x)

    def dense_spy(self: Linear, x: torch.Tensor) -> torch.Tensor:
        rows["dense"].append(x.shape[0])
        return dense_call(self, x)

    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request(PROMPT, params)
    engine.add_request(PROMPT[:4], params)
    engine.step()  # two prompts
    engine.add_request(OTHERS[0][:6], params)
    monkeypatch.setattr(Int4Linear, "__call__", int4_spy)
    monkeypatch.setattr(Linear, "__call__", dense_spy)
    engine.step()  # two decode rows beside a 6-token prompt that completes
    layers = 4 * engine.model.cfg.num_layers
    assert rows["int4"] == [2] * layers
    assert rows["dense"] == [6] * layers + [2, 1]  # the LM head: decode rows, then the completed prompt
    assert engine.model.steps_by_phase == {"prefill": 1, "mixed": 1}
