"""`edgeserve bench all` / `make bench`: choosing benchmarks, reading their reports' targets and headlines,
running one as a child process (a failure is reported, not raised), the summary table."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ops import bench
from ops.bench import all as bench_all

ROOT = Path(__file__).resolve().parents[2]


def test_selected_keeps_registry_order_and_refuses_unknown_names() -> None:
    names = ["engine", "kv-capacity", "integrity", "routing"]
    assert bench_all.selected(names, None, None) == names
    assert bench_all.selected(names, "routing,engine", None) == ["engine", "routing"]
    assert bench_all.selected(names, None, "kv-capacity") == ["engine", "integrity", "routing"]
    with pytest.raises(ValueError, match="enigne"):
        bench_all.selected(names, "enigne", None)


def test_every_registered_benchmark_is_run_but_not_all_itself() -> None:
    names = [n for n in bench.BENCHES if n != "all"]
    assert bench_all.selected(names, None, None) == names and "engine" in names and "routing" in names


def test_variants_run_right_after_their_benchmark_with_arguments_it_takes() -> None:
    import argparse
    import importlib

    names = [n for n in bench.BENCHES if n not in ("all", *bench_all.PART_OF)]
    order = bench_all.run_order(names)
    assert [n for n in order if n not in bench_all.VARIANTS] == names
    for variant, (base, extra) in bench_all.VARIANTS.items():
        assert order.index(variant) == order.index(base) + 1
        assert bench_all.selected(order, variant, None) == [variant]  # runs on its own with --only
        p = argparse.ArgumentParser()  # its arguments are the benchmark's own (a typo would fail here)
        importlib.import_module(bench.BENCHES[base]).add_arguments(p)
        p.parse_args(extra)


def test_targets_of_reads_every_shape_in_use() -> None:
    assert bench_all.targets_of({"targets": {"a": True, "b": False}}) == {"a": "met", "b": "missed"}  # kv, moe
    assert bench_all.targets_of({"targets": {"mixed": {"target": "TPOT ratio", "met": False}}}) == {
        "TPOT ratio": "missed"}  # pd
    assert bench_all.targets_of({"targets": [{"target": "hit rate", "met": True, "value": 0.6},
                                             {"name": "no 5xx", "met": False}]}) == {"hit rate": "met",
                                                                                      "no 5xx": "missed"}  # soak
    assert bench_all.targets_of({"targets": {"cpu_lt_1pct": {"met": False, "verdict": "unresolved"}}}) == {
        "cpu_lt_1pct": "unresolved"}  # integrity: an interval straddling the limit is not a miss
    assert bench_all.targets_of({"targets_met": True}) == {"targets_met": "met"}  # structured
    assert bench_all.targets_of({"results": []}) == {}


def test_headline_prefers_the_reports_own() -> None:
    assert bench_all.headline_of("engine", {"headline": {"c1_vs_hf_sequential": 1.2}, "ratios": {}}) == {
        "c1_vs_hf_sequential": 1.2}
    report = {"capacity_ratio": 1.97, "throughput_ratio_fp8_over_bf16": {"1": 0.8, "4": 0.7},
              "ppl_relative_fp8_vs_bf16": 0.001, "sweep": [1, 2]}
    assert bench_all.headline_of("kv-capacity", report) == {
        "capacity_ratio": 1.97, "throughput_ratio_fp8_over_bf16.1": 0.8, "throughput_ratio_fp8_over_bf16.4": 0.7,
        "ppl_relative_fp8_vs_bf16": 0.001}
    assert bench_all.headline_of("kernels", {"x": 1}) == {}


def _script(tmp_path: Path, body: str) -> list[str]:
    path = tmp_path / "fake_bench.py"
    path.write_text(body)
    return [sys.executable, str(path)]


def test_run_one_reads_the_report_and_reports_failures(tmp_path: Path) -> None:
    report, log = tmp_path / "x.json", tmp_path / "x.log"
    ok = _script(tmp_path, "import json, sys\nprint('measuring')\njson.dump({'headline': {'ratio': 2.5}, "
                           "'targets': {'fast': True, 'small': False}, 'provenance': {'commit': 'abc123', "
                           "'dirty': True}}, open(sys.argv[1], 'w'))\n")
    out = bench_all.run_one("x", ok + [str(report)], report, log, timeout_s=60)
    assert out.status == "ok" and out.headline == {"ratio": 2.5} and out.targets == {"fast": "met", "small": "missed"}
    assert (out.commit, out.dirty) == ("abc123", True) and "measuring" in log.read_text() and out.seconds > 0
    # a crash after an earlier run's report: failed, and the stale report is not read as this run's
    crash = _script(tmp_path, "raise SystemExit(3)\n")
    out = bench_all.run_one("x", crash, report, log, timeout_s=60)
    assert out.status == "failed (exit 3)" and out.headline == {} and not report.exists()
    silent = _script(tmp_path, "pass\n")
    assert bench_all.run_one("x", silent, report, log, timeout_s=60).status == "no report"
    partial = _script(tmp_path, "import json, sys\njson.dump({'skipped': {'moe': 'no CUDA device'}}, "
                                "open(sys.argv[1], 'w'))\n")  # ran what it could: ok, saying what it left out
    assert bench_all.run_one("x", partial + [str(report)], report, log, timeout_s=60).status == \
        "ok; skipped moe (no CUDA device)"
    hang = _script(tmp_path, "import time\ntime.sleep(30)\n")
    assert bench_all.run_one("x", hang, report, log, timeout_s=0.5).status == "timed out after 0.5 s"


def test_summary_markdown_one_row_per_benchmark() -> None:
    rows = [bench_all.BenchOutcome("engine", "ok", 61.2, [], "e.json", "e.log", "0123456789abcdef", False,
                                   {"c1_vs_hf_sequential": 1.234567, "nan": float("nan")},
                                   {"c1_ge_1.5x": "missed", "c32_ge_1.5x_batched": "met", "p95": "unresolved"}),
            bench_all.BenchOutcome("routing", "failed (exit 1)", 3.0, [], "r.json", "r.log")]
    rows[0].busy_cpus_before = 0.031
    md = bench_all.summary_markdown(rows).splitlines()
    assert md[0].startswith("| benchmark | status | seconds | commit |") and len(md) == 4
    assert md[2] == ("| engine | ok | 61 | 0123456789 | c1_vs_hf_sequential 1.23, nan nan | 1/3 met; MISSED "
                     "c1_ge_1.5x; UNRESOLVED p95 | 0.03 |")
    assert md[3] == "| routing | failed (exit 1) | 3 |  |  |  |  |"


def test_wait_idle_sees_a_busy_cpu_and_returns_at_once_on_an_idle_threshold() -> None:
    """A spinning child keeps about one CPU busy: waiting for idle runs to its limit and says so; a threshold
    above every CPU returns after one window."""
    from ops.bench.harness.procs import wait_idle

    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        busy, waited = wait_idle(busy_below=0.5, window_s=0.3, max_wait_s=0.9)
        assert busy >= 0.5 and 0.9 <= waited < 3.0
    finally:
        spinner.kill()
        spinner.wait()
    busy, waited = wait_idle(busy_below=(os.cpu_count() or 1) + 1, window_s=0.2, max_wait_s=10)
    assert waited < 1.0 and 0 <= busy <= (os.cpu_count() or 1) + 0.01


def test_make_bench_runs_the_runner(tmp_path: Path) -> None:
    for name in ("Makefile", "pyproject.toml"):
        (tmp_path / name).write_text((ROOT / name).read_text())
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    done = subprocess.run(["make", "--no-print-directory", "-n", "bench", "BENCH_ARGS=--only engine"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.rstrip().endswith(".venv/bin/python -m ops.bench.all --only engine"), done.stdout


def test_main_parses_the_bench_options(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="unknown benchmarks \\['nope'\\]"):
        bench_all.main(["--only", "nope", "--json", str(tmp_path / "all.json")])
    assert not (tmp_path / "all.json").exists()


def test_a_timed_out_benchmark_takes_the_processes_it_started_with_it(tmp_path: Path) -> None:
    pid_file = tmp_path / "worker.pid"
    hang = _script(tmp_path, "import subprocess, sys, time\n"
                             "worker = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                             f"open({str(pid_file)!r}, 'w').write(str(worker.pid))\n"
                             "time.sleep(60)\n")
    out = bench_all.run_one("x", hang, tmp_path / "x.json", tmp_path / "x.log", timeout_s=3)
    assert out.status == "timed out after 3 s" and out.seconds < 20
    worker = int(pid_file.read_text())
    state = Path(f"/proc/{worker}/stat")
    assert not state.exists() or state.read_text().split(")")[1].split()[0] == "Z", "the benchmark's worker survived"
