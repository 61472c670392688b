"""`edgeserve bench engine`: the pure helpers (rotation, run order, per-round ratios, targets); no model run."""

from __future__ import annotations

import argparse
import time
from collections import Counter

import pytest
import torch

from ops import bench
from ops.bench import engine as bench_engine
from ops.bench.engine_systems import Timings, pick_hf_dtype
from ops.bench.harness.stats import rotated


def test_rotated_is_a_latin_rotation() -> None:
    items = ["a", "b", "c"]
    square = [rotated(items, r) for r in range(3)]
    assert square == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    for position in range(3):  # every item once in every position
        assert sorted(row[position] for row in square) == items
    assert rotated(items, 4) == square[1] and rotated([], 2) == []
    assert items == ["a", "b", "c"]  # not modified


def test_schedule_runs_every_system_on_every_level_each_round_in_rotated_order() -> None:
    order = bench_engine.schedule([1, 8, 32], rounds=3, with_hf=True)
    assert Counter((c, s) for _, c, s in order) == {
        (1, "edgeserve"): 3, (1, "hf_sequential"): 3,  # no static batch of one: that is hf_sequential
        (8, "edgeserve"): 3, (8, "hf_sequential"): 3, (8, "hf_batched"): 3,
        (32, "edgeserve"): 3, (32, "hf_sequential"): 3, (32, "hf_batched"): 3}
    assert [r for r, _, _ in order] == sorted(r for r, _, _ in order)  # round by round
    for c in (8, 32):  # over 3 rounds each system goes first, second and third once
        per_round = [[s for r2, c2, s in order if (r2, c2) == (r, c)] for r in range(3)]
        for position in range(3):
            assert sorted(run[position] for run in per_round) == ["edgeserve", "hf_batched", "hf_sequential"]
    assert bench_engine.schedule([1, 8], rounds=2, with_hf=False) == [(0, 1, "edgeserve"), (0, 8, "edgeserve"),
                                                                       (1, 1, "edgeserve"), (1, 8, "edgeserve")]


def test_ratios_pair_systems_within_each_round() -> None:
    t = lambda tokens, wall: Timings(wall, tokens, 1, [0.1], [0.01])  # noqa: E731
    by_round = {("edgeserve", 8, 0): t(100, 1.0), ("hf_sequential", 8, 0): t(100, 5.0),  # 5x
                ("edgeserve", 8, 1): t(100, 2.0), ("hf_sequential", 8, 1): t(100, 8.0),  # 4x (a slower round)
                ("edgeserve", 8, 2): t(100, 1.0), ("hf_sequential", 8, 2): t(100, 7.0),  # 7x
                ("edgeserve", 1, 0): t(10, 1.0)}
    r = bench_engine.ratios(by_round, [1, 8], 3, "hf_sequential")
    assert list(r) == ["8"]  # level 1's baseline did not run
    assert r["8"]["per_round"] == pytest.approx([5.0, 4.0, 7.0])
    assert (r["8"]["median"], r["8"]["min"], r["8"]["max"]) == pytest.approx((5.0, 4.0, 7.0))
    # pooling the rounds first would give 300/4 over 300/20 = 5.0 here too, but pairs by round keep a
    # slow spell from landing on one system only
    assert bench_engine.ratios(by_round, [8], 3, "hf_batched") == {}


def test_timings_pool_and_summarise() -> None:
    a = Timings(2.0, 40, 2, [0.1, 0.3], [0.02, 0.04])
    b = Timings(1.0, 20, 1, [0.2], [0.03])
    pooled = a + b
    assert (pooled.wall_s, pooled.tokens, pooled.requests) == (3.0, 60, 3)
    res = pooled.result("edgeserve", 8, 8)
    assert res.output_tok_s == pytest.approx(20.0) and res.ttft_p50_s == 0.2 and res.tpot_p95_s == 0.04
    assert res.round == -1 and a.result("edgeserve", 8, 8, 2).round == 2


def test_prompt_tokens_count_at_their_layers_flops() -> None:
    # 2 requests: 30 + 10 prompt tokens, 10 + 10 output tokens -> 2 prompt tokens per output token
    workload = [([1] * 30, 10), ([2] * 10, 10)]
    assert bench_engine.pct_all_tokens(20.0, workload, layer_share=1.0) == pytest.approx(60.0)
    # the LM head is a quarter of an output token's FLOPs: a prompt token costs three quarters of one
    assert bench_engine.pct_all_tokens(20.0, workload, layer_share=0.75) == pytest.approx(20.0 * (1 + 2 * 0.75))
    assert bench_engine.pct_all_tokens(20.0, [([], 10)], layer_share=0.75) == pytest.approx(20.0)


def test_gemm_ceiling_is_what_every_token_at_the_gemm_rate_would_read() -> None:
    workload = [([1] * 30, 10), ([2] * 10, 10)]  # 2 prompt tokens per output token
    assert bench_engine.gemm_ceiling_pct(workload, layer_share=1.0) == pytest.approx(100 / 3)
    ceiling = bench_engine.gemm_ceiling_pct(workload, layer_share=0.75)
    assert bench_engine.pct_all_tokens(ceiling, workload, layer_share=0.75) == pytest.approx(100.0)
    assert bench_engine.gemm_ceiling_pct([([], 10)], layer_share=0.75) == pytest.approx(100.0)


class _WordTokenizer:
    """One id per word, after a fixed template: enough for `_make_workload`'s requests."""

    def apply_chat_template(self, messages, add_generation_prompt: bool) -> str:
        return "<user> " + messages[-1]["content"] + " <assistant>"

    def encode(self, text: str) -> list[int]:
        return [len(w) for w in text.split()]


def test_quick_run_judges_the_gemm_figure_on_the_full_runs_top_level_requests() -> None:
    tok = _WordTokenizer()
    (lo, hi), waves = bench_engine.workload_shape(quick=False)
    full_top = bench_engine._make_workload(tok, 32 * waves, lo, hi, seed=32)  # what a full run's c=32 level runs
    assert bench_engine.gemm_workload(tok, 32) == full_top
    (qlo, qhi), qwaves = bench_engine.workload_shape(quick=True)
    quick_top = bench_engine._make_workload(tok, 32 * qwaves, qlo, qhi, seed=32)
    assert len(quick_top) < len(full_top) and qhi <= lo  # the quick levels' requests are fewer and shorter
    # shorter answers to the same prompts: more prompt tokens per output token, a lower ceiling
    assert bench_engine.gemm_ceiling_pct(quick_top, 0.8) < bench_engine.gemm_ceiling_pct(full_top, 0.8)


def test_targets_on_the_medians() -> None:
    seq = {"1": {"median": 1.5}, "32": {"median": 9.9}}
    bat = {"32": {"median": 1.6}}
    assert bench_engine.engine_targets(seq, bat, {"1": 60.0, "32": 35.0}) == {
        "c1_ge_1.5x_hf_sequential": True, "c32_ge_10x_hf_sequential": False, "c32_ge_1.5x_hf_batched": True,
        "c32_ge_35pct_of_gemm_bound": True}
    assert bench_engine.engine_targets({"8": {"median": 3.0}}, {}, {}) == {}  # no level the targets name


def test_registered_with_rounds() -> None:
    parser = argparse.ArgumentParser()
    bench.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "engine", "--quick", "--rounds", "4"])
    assert args.func.__wrapped__ is bench_engine.run and args.rounds == 4 and args.quick
    assert parser.parse_args(["bench", "engine"]).rounds is None  # the run picks 3 (quick 2)


class _SlowIn(torch.nn.Module):
    """A model whose forward takes longer in one dtype: the choice `pick_hf_dtype` must see."""

    def __init__(self, slow: torch.dtype) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4))
        self.slow = slow
        self.calls: list[torch.dtype] = []

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.calls.append(self.w.dtype)
        time.sleep(0.02 if self.w.dtype == self.slow else 0.0)
        return ids


@pytest.mark.parametrize("slow, expected", [(torch.bfloat16, "float32"), (torch.float32, "bfloat16")])
def test_pick_hf_dtype_keeps_the_faster_dtype(slow: torch.dtype, expected: str) -> None:
    model, info = pick_hf_dtype(_SlowIn(slow), torch.bfloat16, "auto")
    assert info["dtype"] == expected and model.w.dtype == getattr(torch, expected)
    assert set(info["probe_s"]) == {"float32", "bfloat16"}
    assert info["probe_s"]["float32" if expected == "bfloat16" else "bfloat16"] > info["probe_s"][expected]
    assert set(model.calls) == {torch.float32, torch.bfloat16}  # both were timed


def test_pick_hf_dtype_without_a_probe() -> None:
    cases = (("same", torch.bfloat16, torch.bfloat16), ("float32", torch.bfloat16, torch.float32),
             ("bfloat16", torch.float32, torch.bfloat16), ("auto", torch.float32, torch.float32))
    for choice, dtype, expected in cases:
        model, info = pick_hf_dtype(_SlowIn(torch.float32), dtype, choice)
        assert model.w.dtype == expected and info["dtype"] == str(expected).removeprefix("torch.")
        assert model.calls == [] and "probe_s" not in info
