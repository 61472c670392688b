"""`edgeserve bench kv-capacity`: the pure helpers (budget, capacity, sweep points, agreement); no model run."""

from __future__ import annotations

import argparse
import itertools
import time
from types import SimpleNamespace

import pytest

from backend.config import ModelConfig
from backend.engine import StepOutput
from backend.kv_cache import kv_bytes_per_token
from backend.sampling_params import SamplingParams
from backend.sequence import Sequence
from ops import bench
from ops.bench import kv as bench_kv

# SmolLM2-135M's shape (30 layers, 3 KV heads, head_dim 64)
SMOLLM2 = ModelConfig(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192,
                      rms_norm_eps=1e-5, rope_theta=100000.0, rope_scaling=None, tie_word_embeddings=True,
                      attention_bias=False)


@pytest.mark.parametrize(("n", "prompt", "output"),
                         [(8, 128, 64), (4, 64, 32), (32, 1000, 200), (1, 5, 1), (50, 17, 16)])
def test_budget_admits_n_bf16_and_2n_fp8(n: int, prompt: int, output: int) -> None:
    shape = bench_kv.Shape(prompt, output, 16, n)
    budget = bench_kv.kv_budget(SMOLLM2, shape)
    assert bench_kv.admitted_requests(SMOLLM2, "bf16", budget, shape) == n
    assert bench_kv.admitted_requests(SMOLLM2, "fp8_e4m3", budget, shape) == 2 * n
    assert bench_kv.admitted_requests(SMOLLM2, "fp8_e4m3", budget - 1, shape) == 2 * n - 1  # the smallest such


def test_capacity_report_for_the_default_shape() -> None:
    shape = bench_kv.Shape(128, 64, 16, 8)
    assert shape.pages_per_request == 12
    cap = bench_kv.capacity_report(SMOLLM2, shape, bench_kv.kv_budget(SMOLLM2, shape))
    per = cap["per_format"]
    assert (per["bf16"]["bytes_per_token"], per["fp8"]["bytes_per_token"]) == (23_040, 11_700)
    assert kv_bytes_per_token(SMOLLM2, "fp32") == 46_080
    assert cap["bytes_ratio_exact"] == "23040/11700" and cap["bytes_ratio"] == pytest.approx(1.96923, abs=1e-5)
    assert per["fp8"]["pages"] == 192 and per["fp8"]["tokens"] == 192 * 16
    assert per["bf16"]["pages"] == 97 and per["bf16"]["requests"] == 8  # 97 // 12
    assert cap["requests_ratio"] == 2.0 and cap["tokens_ratio"] == pytest.approx(192 / 97)
    # a budget of exactly 8 BF16 requests (96 pages) holds 189 FP8 pages: 15 requests, not 16
    assert cap["fp8_requests_at_exact_bf16_budget"] == 15


def test_sweep_points_reach_twice_the_fp8_capacity() -> None:
    assert bench_kv.sweep_points(8) == [1, 4, 8, 12, 16, 32]
    assert bench_kv.sweep_points(4) == [1, 2, 4, 6, 8, 16]
    assert bench_kv.sweep_points(1) == [1, 2, 4]
    assert bench_kv.sweep_points(4, quick=True) == [1, 4, 8, 16]
    assert [bench_kv.requests_at(c) for c in (1, 2, 16)] == [2, 2, 16]


class FakeEngine:
    """Admits up to `capacity` requests; each running one gets a token per step."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.scheduler = SimpleNamespace(running=[], waiting=[])
        self._ids = itertools.count()

    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        seq = Sequence(f"r{next(self._ids)}", prompt_ids, params)
        self.scheduler.waiting.append(seq)
        return seq

    def step(self) -> list[StepOutput]:
        sched = self.scheduler
        while sched.waiting and len(sched.running) < self.capacity:
            sched.running.append(sched.waiting.pop(0))
        outputs = []
        for seq in list(sched.running):
            seq.output_ids.append(7)
            done = len(seq.output_ids) == seq.params.max_tokens
            if done:
                sched.running.remove(seq)
            outputs.append(StepOutput(seq, 7, time.perf_counter(), done))
        return outputs


def test_closed_loops_in_turn_measure_admission_and_tokens() -> None:
    engines = {"bf16": FakeEngine(2), "fp8": FakeEngine(4)}
    rows = bench_kv.run_point(engines, [[1, 2, 3]], c=8, requests=8, output_tokens=5)
    assert [r.kv for r in rows] == ["bf16", "fp8"]
    assert [r.admitted for r in rows] == [2, 4]
    for r in rows:
        assert r.requests == 8 and r.output_tok_s > 0 and r.wall_s > 0
        assert r.output_tok_s == pytest.approx(8 * 5 / r.wall_s)
        assert 0 <= r.ttft_p50_s <= r.ttft_p95_s and r.tpot_p50_s > 0


def test_agreement_prefix_and_positional() -> None:
    base = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    ours = [[1, 2, 3, 4], [5, 0, 7, 8], [0, 9, 9, 9]]
    a = bench_kv.agreement(ours, base)
    assert a["first_divergence"] == [4, 1, 0]
    assert a["prefix"] == pytest.approx(5 / 12) and a["positional"] == pytest.approx(10 / 12)
    assert (a["identical"], a["sequences"], a["positions"]) == (1, 3, 12)
    assert bench_kv.agreement(base, base)["prefix"] == 1.0


def test_registered_with_quick_defaults() -> None:
    parser = argparse.ArgumentParser()
    bench.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "kv-capacity", "--quick", "--json", "/tmp/x.json"])
    assert args.func.__wrapped__ is bench_kv.run and args.json_path == "/tmp/x.json"
    bench_kv._defaults(args)
    assert (args.requests, args.prompt_tokens, args.output_tokens, args.no_reference) == (4, 64, 32, True)
    full = parser.parse_args(["bench", "kv-capacity"])
    bench_kv._defaults(full)
    assert (full.requests, full.greedy_prompts, full.ppl_windows, full.no_reference) == (8, 20, 20, False)
