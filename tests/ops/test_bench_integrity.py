"""`edgeserve bench integrity`: the pure helpers (decode timing, overheads, spread); no model run."""

from __future__ import annotations

import argparse

import pytest

from ops import bench, bench_integrity
from tests.ops.test_bench_kv import FakeEngine


def test_decode_row_weights_gaps_by_requests_in_the_step() -> None:
    # 3 decode steps: 0.1 s with 4 requests, 0.2 s with 4, 1.0 s with 1 (a straggler)
    row = bench_integrity.decode_row("on", 4, 0, [(0.1, 4), (0.2, 4), (1.0, 1)], wall_s=5.0)
    assert row.decode_tok_s == pytest.approx(9 / 1.3)
    assert row.decode_steps == 3 and row.decode_s == pytest.approx(1.3) and row.wall_s == 5.0
    assert row.tpot_p50_s == 0.2  # gaps: 4 x 0.1, 4 x 0.2, 1 x 1.0
    assert row.tpot_p95_s == 1.0


def test_overhead_sign_means_cost() -> None:
    assert bench_integrity.overhead_pct(99.0, 100.0, higher_is_better=True) == pytest.approx(1.0)
    assert bench_integrity.overhead_pct(101.0, 100.0, higher_is_better=True) == pytest.approx(-1.0)
    assert bench_integrity.overhead_pct(0.0202, 0.02, higher_is_better=False) == pytest.approx(1.0)


def test_overheads_pair_settings_per_concurrency_and_repeat() -> None:
    row = lambda s, c, rep, tput, p95: bench_integrity.DecodeRow(s, c, rep, tput, 0.0, p95, 1, 1.0, 1.0)  # noqa: E731
    rows = [row("on", 8, 0, 99.0, 0.0101), row("off", 8, 0, 100.0, 0.0100),
            row("off", 8, 1, 50.0, 0.0200), row("on", 8, 1, 50.5, 0.0198),
            row("on", 32, 0, 200.0, 0.05), row("off", 32, 0, 200.0, 0.05)]
    over = bench_integrity.overheads(rows)
    assert over["throughput"][8] == pytest.approx([1.0, -1.0])
    assert over["p95"][8] == pytest.approx([1.0, -1.0])
    assert over["throughput"][32] == [0.0] and over["p95"][32] == [0.0]
    assert bench_integrity.spread([3.0, -1.0, 2.0]) == {"median": 2.0, "min": -1.0, "max": 3.0}


def test_decode_loops_in_turn_time_only_decode_steps() -> None:
    # FakeEngine gives every running request a token each step: the first step is each request's
    # first token (prefill), the other output_tokens - 1 are decode steps with all c requests
    engines = {"on": FakeEngine(8), "off": FakeEngine(8)}
    loops = [bench_integrity.DecodeLoop(e, name, [[1, 2, 3]], 4, 4, 6) for name, e in engines.items()]
    bench_integrity.step_in_turn(loops)
    for loop in loops:
        assert loop.done and loop.tokens == 4 * 6
        assert [n for _, n in loop.decode_steps] == [4] * 5
        row = loop.decode_row(0)
        assert row.decode_steps == 5 and row.decode_tok_s == pytest.approx(20 / row.decode_s)
        assert 0 < row.decode_s <= row.wall_s


def test_registered_with_quick_points() -> None:
    parser = argparse.ArgumentParser()
    bench.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "integrity", "--quick", "--json", "/tmp/x.json"])
    assert args.func.__wrapped__ is bench_integrity.run and args.json_path == "/tmp/x.json" and args.quick
    assert bench_integrity.concurrency_points(True) == [8, 16]
    assert bench_integrity.concurrency_points(False) == [8, 32, 64]
