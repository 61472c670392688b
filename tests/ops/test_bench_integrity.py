"""`edgeserve bench integrity`: the pure helpers (decode timing, paired overheads, bootstrap interval,
check timer, calibration arm); no model run."""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import numpy as np
import pytest

from ops import bench
from ops.bench import integrity as bench_integrity
from ops.bench.harness.loops import DecodeLoop, decode_row, step_in_turn
from ops.bench.harness.stats import block_bootstrap_ci
from tests.ops.test_bench_kv import FakeEngine


def test_decode_row_weights_gaps_by_requests_in_the_step() -> None:
    # 3 decode steps: 0.1 s with 4 requests, 0.2 s with 4, 1.0 s with 1 (a straggler)
    row = decode_row("on", 4, 0, [(0.1, 4), (0.2, 4), (1.0, 1)], wall_s=5.0)
    assert row.decode_tok_s == pytest.approx(9 / 1.3)
    assert row.decode_steps == 3 and row.decode_s == pytest.approx(1.3) and row.wall_s == 5.0
    assert row.tpot_p50_s == 0.2  # gaps: 4 x 0.1, 4 x 0.2, 1 x 1.0
    assert row.tpot_p95_s == 1.0


def test_paired_overheads() -> None:
    off = np.array([0.10, 0.20, 0.30])
    assert bench_integrity.throughput_overhead(off * 1.01, off) == pytest.approx(100 * (1 - 1 / 1.01))
    assert bench_integrity.throughput_overhead(off, off) == 0.0
    on = np.array([0.10, 0.20, 0.33])
    assert bench_integrity.p95_overhead(on, off) == pytest.approx(10.0)  # nearest rank: the largest of 3


def _paired_steps(rng: np.random.Generator, n: int, cost: float, burst: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """n paired step times: a shared slow drift (machine load), 3% independent noise each, and (`burst`) a
    burst of load on 3 consecutive steps of one side or the other; `a` costs `cost` (a fraction) more."""
    base = 0.1 * (1 + 0.3 * np.sin(np.arange(n) / 7))
    b = base * (1 + 0.03 * rng.standard_normal(n))
    a = base * (1 + cost) * (1 + 0.03 * rng.standard_normal(n))
    start = int(rng.integers(0, n - 4))
    if burst:
        (a if rng.random() < 0.5 else b)[start:start + 3] *= 1.5
    return a, b


def test_bootstrap_interval_separates_a_one_percent_cost() -> None:
    rng = np.random.default_rng()  # fresh data every run
    lo, hi = block_bootstrap_ci([_paired_steps(rng, 600, 0.01) for _ in range(3)],
                                                bench_integrity.throughput_overhead, resamples=500)
    assert 0 < lo and hi - lo < 1.5  # 1% (0.99 points) is resolved; a burst moves the centre ~0.4 points


def test_bootstrap_interval_covers_the_truth_as_often_as_it_says() -> None:
    rng = np.random.default_rng()
    covered = 0
    for _ in range(40):
        lo, hi = block_bootstrap_ci([_paired_steps(rng, 200, 0.0, burst=False) for _ in range(2)],
                                                    bench_integrity.throughput_overhead, resamples=300)
        covered += lo <= 0 <= hi
    assert covered >= 32  # ~38 of 40 for a 95% interval; under 32 means it is too narrow (p < 0.001)


def test_bootstrap_keeps_pairs_and_strata() -> None:
    a = [1.0, 2.0, 3.0, 4.0]
    lo, hi = block_bootstrap_ci([(a, a), ([5.0], [5.0])], bench_integrity.throughput_overhead)
    assert lo == hi == 0.0  # a pair never meets another pair's partner
    seen: list[int] = []
    block_bootstrap_ci([([1.0] * 5, [1.0] * 5), ([2.0] * 3, [2.0] * 3)],
                                       lambda x, y: seen.append((x.size, int((x == 2.0).sum()))) or 0.0,
                                       resamples=10)
    assert set(seen) == {(8, 3)}  # every resample keeps each stratum's size
    assert np.isnan(block_bootstrap_ci([([], [])], bench_integrity.throughput_overhead)).all()


class _Engine:
    """Just the method `CheckTimer` wraps: a check that takes `check_s` of CPU."""

    def __init__(self, check_s: float) -> None:
        self.check_s, self.batches = check_s, []

    def _check_integrity(self, batch):
        self.batches.append(batch)
        bench_integrity.busy_wait(self.check_s)
        return batch, []


def test_check_timer_times_the_check_and_spins_apart() -> None:
    engine = _Engine(0.002)
    timer = bench_integrity.CheckTimer(engine)
    assert engine._check_integrity("b1") == ("b1", []) and engine.batches == ["b1"]
    assert timer.calls == 1 and timer.seconds >= 0.002 and timer.cpu >= 0.002 and timer.spun == timer.spun_cpu == 0
    timer.spin_cpu_s = 0.003
    engine._check_integrity("b2")
    assert timer.calls == 2 and timer.spun >= 0.003 and timer.spun_cpu >= 0.003
    assert 0.004 <= timer.cpu < 0.0065  # two 2 ms checks; the 3 ms spin is not counted as the check


def test_busy_wait_spends_cpu_time_not_just_wall_time() -> None:
    wall, cpu = bench_integrity.busy_wait(0.005)
    assert cpu >= 0.005 and wall >= cpu * 0.5  # (process CPU may run ahead of wall with other threads busy)


def test_step_in_turn_rotates_the_first_mover() -> None:
    order: list[str] = []

    class Loop:
        def __init__(self, name: str) -> None:
            self.name, self.left = name, 3

        @property
        def done(self) -> bool:
            return self.left == 0

        def step(self) -> None:
            order.append(self.name)
            self.left -= 1

    step_in_turn([Loop("a"), Loop("b"), Loop("c")])
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]


def test_decode_loops_in_turn_time_only_decode_steps() -> None:
    # FakeEngine gives every running request a token each step: the first step is each request's
    # first token (prefill), the other output_tokens - 1 are decode steps with all c requests
    engines = {"on": FakeEngine(8), "off": FakeEngine(8)}
    loops = [DecodeLoop(e, name, [[1, 2, 3]], 4, 4, 6) for name, e in engines.items()]
    step_in_turn(loops)
    for loop in loops:
        assert loop.done and loop.tokens == 4 * 6
        assert [n for _, n in loop.decode_steps] == [4] * 5
        row = loop.decode_row(0)
        assert row.decode_steps == 5 and row.decode_tok_s == pytest.approx(20 / row.decode_s)
        assert 0 < row.decode_s <= row.wall_s



def test_median_tok_s_counts_the_requests_each_step_held() -> None:
    # a loop of c = 8 whose decode steps held fewer (requests that ended before the last one started):
    # per step 2 / 0.1, 4 / 0.1 and 8 / 0.2 tok/s; c / the median time would say 80
    loop = DecodeLoop(FakeEngine(8), "x", [[1, 2, 3]], 8, 8, 6)
    loop.decode_steps = [(0.1, 2), (0.1, 4), (0.2, 8), (0.1, 4), (0.2, 8)]
    assert loop.median_tok_s() == pytest.approx(40.0)
    run = DecodeLoop(FakeEngine(8), "y", [[1, 2, 3]], 8, 8, 6)
    step_in_turn([run])  # every decode step holds all 8: the median step's time alone decides
    assert run.median_tok_s() == pytest.approx(8 / statistics.median(dt for dt, _ in run.decode_steps))

def test_registered_with_quick_points() -> None:
    parser = argparse.ArgumentParser()
    bench.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "integrity", "--quick", "--json", "/tmp/x.json"])
    assert args.func.__wrapped__ is bench_integrity.run and args.json_path == "/tmp/x.json" and args.quick
    assert bench_integrity.concurrency_points(True) == [8, 16]
    assert bench_integrity.concurrency_points(False) == [8, 32, 64]


class _CheckedEngine(FakeEngine):
    """A `FakeEngine` whose step runs a 1 ms check and 4 ms of model first, as `LLMEngine._run_batch` does,
    and then waits 4 ms without using CPU time (as a step whose work runs on other threads would look from
    this one): its wall time is ~1.8x its process CPU time."""

    def _check_integrity(self, batch):
        bench_integrity.busy_wait(0.001)
        return batch, []

    def step(self):
        self._check_integrity(None)
        bench_integrity.busy_wait(0.004)
        time.sleep(0.004)
        return super().step()


def test_calibration_arm_spins_a_share_of_its_previous_decode_step() -> None:
    engine = _CheckedEngine(8)
    loop = bench_integrity.CheckedDecodeLoop(engine, "on+inject", [[1, 2, 3]], 4, 4, 6,
                                             timer=bench_integrity.CheckTimer(engine), inject=0.5)
    step_in_turn([loop])
    steps, cpu = [dt for dt, _ in loop.decode_steps], loop.decode_cpu
    assert len(steps) == len(cpu) == len(loop.check_s) == len(loop.check_cpu) == len(loop.spin_cpu) == 5
    assert all(0.001 <= c < s for c, s in zip(loop.check_s, steps))  # the check's time is inside its step
    assert all(0.001 <= c < s for c, s in zip(loop.check_cpu, cpu))
    assert loop.spin_cpu[0] == 0.0  # nothing to scale from before the first decode step
    for k in range(1, 5):  # half the previous step's wall time without its spin, spun in CPU time
        assert 0.5 * (steps[k - 1] - loop.spin_s[k - 1]) <= loop.spin_cpu[k] < cpu[k] and loop.spin_s[k] > 0
        assert steps[k - 1] - loop.spin_s[k - 1] >= 0.005  # check + model
    assert loop.timer.spin_cpu_s == pytest.approx(0.5 * (steps[-1] - loop.spin_s[-1]))  # the next step's target


def test_compare_pools_repetitions_and_reports_the_injected_share() -> None:
    def loop(steps: list[float], spins: list[float] | None = None) -> SimpleNamespace:
        spins = spins or [0.0] * len(steps)
        return SimpleNamespace(decode_steps=[(dt, 4) for dt in steps], spin_s=spins,
                               decode_cpu=[dt / 2 for dt in steps], spin_cpu=[s / 2 for s in spins])

    a1, a2 = [0.101] * 10, [0.202] * 10
    loops = {("on+inject", 8): [loop(a1, [0.001] * 10), loop(a2, [0.002] * 10)],
             ("on", 8): [loop([0.1] * 10), loop([0.2] * 12)]}  # a longer run: only the paired steps count
    r = bench_integrity.compare(loops, "on+inject", "on", 8)
    assert r["pairs"] == 20
    assert r["throughput_pct"] == pytest.approx(100 * (1 - 3.0 / 3.03))
    assert r["throughput_per_repeat"] == pytest.approx([100 * (1 - 1 / 1.01)] * 2)
    assert r["throughput_ci95"] == pytest.approx([r["throughput_pct"]] * 2, abs=0.2)
    assert r["injected_pct"] == pytest.approx(100 * 0.03 / 3.03)
    assert r["injected_cpu_pct"] == pytest.approx(100 * 0.03 / 3.03)  # spin and steps both half in CPU here
    assert r["p95_pct"] == pytest.approx(1.0) and r["step_pct"] == pytest.approx(1.0)
    assert r["cpu_pct"] == pytest.approx(r["throughput_pct"])
    assert r["cpu_per_repeat"] == pytest.approx([100 * (1 - 1 / 1.01)] * 2)


def test_verdicts_and_detection() -> None:
    assert [bench_integrity.verdict(ci) for ci in ([-0.5, 0.9], [1.1, 3.0], [0.2, 1.4])] == [
        "met", "missed", "unresolved"]
    r = {"cpu_ci95": [0.6, 1.3], "throughput_ci95": [-2.0, 4.0]}
    assert bench_integrity.detected(r, "cpu", 1.0) and not bench_integrity.detected(r, "cpu", 1.4)
    assert not bench_integrity.detected(r, "throughput", 1.0)  # holds 1 but also 0: not resolved


def test_own_time_p95_takes_each_steps_check_out_of_that_step() -> None:
    def loop(steps: list[float], checks: list[float]) -> SimpleNamespace:
        return SimpleNamespace(decode_steps=[(dt, 8) for dt in steps], check_s=checks)

    flat = [loop([0.1] * 20, [0.001] * 20), loop([0.1] * 30, [0.001] * 30)]
    r = bench_integrity.own_time_p95(flat)
    assert r["p95_own_pct"] == pytest.approx(100 * (0.1 / 0.099 - 1))
    assert r["p95_own_ci95"] == pytest.approx([r["p95_own_pct"]] * 2)
    # a check that lands only on the fast steps leaves the slow 5% (and so the p95) as they were,
    # whatever its share of the total time
    tail = [loop([0.1] * 10 + [0.2] * 10, [0.05] * 10 + [0.0] * 10)]
    assert bench_integrity.own_time_p95(tail)["p95_own_pct"] == pytest.approx(0.0)
    slow = [loop([0.1] * 10 + [0.2] * 10, [0.0] * 10 + [0.01] * 10)]  # on the slow steps it shows in full
    assert bench_integrity.own_time_p95(slow)["p95_own_pct"] == pytest.approx(100 * (0.2 / 0.19 - 1))
