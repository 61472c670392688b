"""Decode graphs (backend/decode_graphs.py): every decode step the graphs' buffers run gives the eager step's
logits and touches no page but the pad page; an engine with them generates what one without them does, frees
every page but the pad page, and never hands the pad page to a request. On the CPU the padded steps run
eagerly from the buffers; on a CUDA device (marked `cuda`) they are captured and replayed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from backend.decode_graphs import buckets
from backend.engine import EngineConfig, LLMEngine
from backend.sampling_params import SamplingParams
from tests.backend.tiny_models import write_tiny_glm4_moe, write_tiny_model

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("graphs") / "m", "llama", seed=11)


def test_buckets_cover_every_row_count_up_to_the_largest() -> None:
    assert buckets(1) == [1]
    assert buckets(5) == [1, 2, 4, 5]
    assert buckets(8) == [1, 2, 4, 8]
    assert buckets(30) == [1, 2, 4, 8, 16, 24, 30]
    assert buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]


def _pages(engine: LLMEngine) -> list[torch.Tensor]:
    out = []
    for i in range(engine.model.local_cfg.num_layers):
        kv = engine.cache.layer(i)
        out += [t.clone() for t in (kv.k, kv.v, kv.k_scale, kv.v_scale) if t is not None]
    return out


def _staggered(engine: LLMEngine, steps_between: int = 2) -> list[list[int]]:
    """Seven greedy requests arriving a few steps apart and ending at different lengths, so decode steps hold
    every row count from 1 to 7 (buckets padded by 0 to 3 rows); their output tokens."""
    prompts = [[5 + i, 9, 13 + 2 * i, 4][: 2 + i % 3] for i in range(7)]
    seqs = []
    for i, prompt in enumerate(prompts):
        seqs.append(engine.add_request(prompt, SamplingParams(max_tokens=14 + 4 * i, **GREEDY)))
        for _ in range(steps_between):
            engine.step()
    while engine.has_work():
        engine.step()
    return [list(s.output_ids) for s in seqs]


@pytest.mark.parametrize("dtype,kv", [("float32", "fp32"), ("bfloat16", "fp8_e4m3")])
def test_every_buffered_step_gives_the_eager_logits_and_writes_only_the_pad_page(tiny_dir: Path, dtype: str,
                                                                                  kv: str) -> None:
    engine = LLMEngine.from_pretrained(tiny_dir, EngineConfig(dtype=dtype, kv_format=kv, kv_cache_bytes=2**20,
                                                              max_num_seqs=6, cuda_graphs=True))
    graphs = engine.runner.graphs
    assert graphs is not None and not graphs.capture and graphs.sizes == [1, 2, 4, 6]
    runner_run = engine.runner.run
    seen: list[int] = []

    def checked(batch):
        if not graphs.takes(batch):
            return runner_run(batch)
        assert all(graphs.pad_page not in s.page_ids for s in batch.decode)
        eager = engine.model.forward(*engine.runner.prepare(batch), engine.cache, float_logits=False)
        before = _pages(engine)  # the eager step wrote this step's K/V; the buffered one writes the same
        logits = runner_run(batch)
        for a, b in zip(before, _pages(engine), strict=True):
            a[graphs.pad_page], b[graphs.pad_page] = 0, 0
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        torch.testing.assert_close(logits.float(), eager.float(), rtol=1e-5, atol=1e-5)
        seen.append(len(batch.decode))
        return logits

    engine.runner.run = checked  # type: ignore[method-assign]
    _staggered(engine)
    assert set(seen) >= {1, 3, 5, 6}  # padded buckets (3 -> 4, 5 -> 6) and exact ones
    assert graphs.replays == len(seen) and graphs.failed is None
    assert engine.allocator.num_used == 1  # every request's pages back; the pad page held for good


@pytest.mark.parametrize("dtype,kv", [("float32", "fp32"), ("bfloat16", "fp8_e4m3")])
def test_an_engine_with_graphs_generates_what_one_without_does(tiny_dir: Path, dtype: str, kv: str) -> None:
    outputs = {}
    for graphs in (False, True):
        engine = LLMEngine.from_pretrained(tiny_dir, EngineConfig(dtype=dtype, kv_format=kv, kv_cache_bytes=2**20,
                                                                  max_num_seqs=8, cuda_graphs=graphs))
        outputs[graphs] = _staggered(engine)
        assert engine.allocator.num_used == int(graphs)
    assert outputs[True] == outputs[False]
    assert [len(o) for o in outputs[True]] == [14 + 4 * i for i in range(7)]


def test_by_default_a_cpu_engine_steps_without_graphs(tiny_dir: Path) -> None:
    engine = LLMEngine.from_pretrained(tiny_dir, EngineConfig(dtype="float32", kv_format="fp32",
                                                              kv_cache_bytes=2**20, max_num_seqs=8))
    assert engine.config.cuda_graphs is None and engine.runner.graphs is None and engine.allocator.num_used == 0


def test_models_with_moe_layers_run_eagerly(tmp_path: Path) -> None:
    model_dir = write_tiny_glm4_moe(tmp_path / "moe", seed=2)
    engine = LLMEngine.from_pretrained(model_dir, EngineConfig(dtype="float32", kv_format="fp32",
                                                               kv_cache_bytes=2**20, cuda_graphs=True))
    assert engine.runner.graphs is None
    assert engine.allocator.num_used == 0  # no pad page held
    seq = engine.add_request([3, 4, 5], SamplingParams(max_tokens=4, **GREEDY))
    while engine.has_work():
        engine.step()
    assert len(seq.output_ids) == 4


CUDA = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available(),
                          reason="needs a CUDA device and TRITON_INTERPRET=0")


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("dtype,kv", [("float32", "fp32"), ("bfloat16", "bf16"), ("bfloat16", "fp8_e4m3")])
def test_cuda_graphs_replay_what_the_eager_steps_compute(tiny_dir: Path, dtype: str, kv: str) -> None:
    outputs, engines = {}, {}
    for graphs in (False, True):
        engines[graphs] = engine = LLMEngine.from_pretrained(tiny_dir, EngineConfig(
            dtype=dtype, kv_format=kv, device="cuda", kv_cache_bytes=2**20, max_num_seqs=8,
            cuda_graphs=None if graphs else False))  # the default on a CUDA device: graphs
        outputs[graphs] = _staggered(engine)
    graphs = engines[True].runner.graphs
    assert graphs is not None and graphs.capture and graphs.failed is None, graphs and graphs.failed
    assert set(graphs.graphs) >= {1, 2, 4, 8} and graphs.replays > 20
    assert outputs[True] == outputs[False]


@pytest.mark.cuda
@CUDA
def test_a_capture_that_fails_leaves_the_engine_stepping_eagerly(tiny_dir: Path, monkeypatch) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("injected capture failure")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", broken)
    engine = LLMEngine.from_pretrained(tiny_dir, EngineConfig(dtype="bfloat16", kv_format="bf16", device="cuda",
                                                              kv_cache_bytes=2**20, cuda_graphs=True))
    seq = engine.add_request([3, 4, 5], SamplingParams(max_tokens=8, **GREEDY))
    while engine.has_work():
        engine.step()
    assert len(seq.output_ids) == 8 and "injected" in engine.runner.graphs.failed
