"""`ops.bench.e2e`: prompts, the closed-loop client against the real stand-in worker, the ratio and
spread maths, the pass order, and the report when llama.cpp is skipped."""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ops.bench import e2e as bench_e2e
from ops.bench.e2e import PassRow


@pytest.fixture(scope="module")
def standin_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The real stand-in worker (`ops.standin_worker`, 7 tokens per request) on a free port."""
    from ops.cluster import child_process, wait_http
    from ops.redis_server import free_port

    port, log = free_port(), tmp_path_factory.mktemp("standin") / "standin.log"
    with child_process([sys.executable, "-m", "ops.standin_worker", "--port", str(port), "--tokens", "7"],
                       log) as proc:
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/health", proc, log, "the stand-in worker", 30)
        yield url


def _row(system: str, fmt: str, c: int, p: int, tok_s: float) -> PassRow:
    return PassRow(system, fmt, c, p, 0, 4, 0, int(tok_s * 2), 2.0, tok_s, 80.0, 95.0, None, {})


def test_prompts_are_unique_deterministic_and_about_80_tokens(smollm2_dir: Path) -> None:
    from backend.tokenizer import Tokenizer

    a, b = bench_e2e.make_prompts("run1-fp32-c8-p0", 16), bench_e2e.make_prompts("run1-fp32-c8-p1", 16)
    assert a == bench_e2e.make_prompts("run1-fp32-c8-p0", 16)
    assert len(set(a) | set(b)) == 32
    tok = Tokenizer.from_model_dir(smollm2_dir)
    ids = [tok.encode_chat([{"role": "user", "content": p}]) for p in a + b]
    assert all(70 <= len(i) <= 95 for i in ids), sorted(len(i) for i in ids)
    heads = {tuple(i[:40]) for i in ids}  # the template's system header is shared, the request's own text is not
    assert len(heads) == 32


def test_chat_body_is_greedy_and_not_streamed() -> None:
    body = bench_e2e.chat_body("hi", 95)
    assert (body["temperature"], body["max_tokens"], body["stream"]) == (0.0, 95, False)
    assert body["messages"] == [{"role": "user", "content": "hi"}]


def test_closed_loop_counts_usage_tokens_from_the_standin(standin_url: str) -> None:
    replies, errors, wall = asyncio.run(bench_e2e.closed_loop(
        f"{standin_url}/v1/chat/completions", {}, bench_e2e.make_prompts("x", 7), 3, 5))
    assert errors == {} and wall > 0
    assert [r.completion_tokens for r in replies] == [5] * 7  # max_tokens 5 of the stand-in's 7
    assert all(r.prompt_tokens > 20 and r.ms_per_token is None for r in replies)  # words; no `timings`
    row = bench_e2e.pass_row("edgeserve", "fp32", 3, 0, 0, replies, errors, wall)
    assert row.tok_s == pytest.approx(35 / wall) and row.mean_completion_tokens == 5


def test_closed_loop_counts_errors_and_sends_every_prompt_once(standin_url: str) -> None:
    replies, errors, _ = asyncio.run(bench_e2e.closed_loop(f"{standin_url}/v1/nowhere", {},
                                                           bench_e2e.make_prompts("y", 5), 2, 5))
    assert replies == [] and errors == {"HTTP 404": 5}


def test_ratios_are_edgeserve_over_llamacpp_means() -> None:
    rows = [_row("edgeserve", "fp32", 1, 0, 10.0), _row("edgeserve", "fp32", 1, 1, 20.0),
            _row("llamacpp", "fp32", 1, 0, 40.0), _row("llamacpp", "fp32", 1, 1, 20.0),
            _row("edgeserve", "int4", 8, 0, 90.0), _row("llamacpp", "int4", 8, 0, 60.0)]
    assert bench_e2e.ratios(rows) == {"fp32": {1: pytest.approx(15 / 30)}, "int4": {8: pytest.approx(1.5)}}
    sp = bench_e2e.spreads(rows)
    assert sp["edgeserve"]["fp32"][1] == pytest.approx(10 / 15)
    assert sp["llamacpp"]["fp32"][1] == pytest.approx(20 / 30)
    assert sp["edgeserve"]["int4"][8] == 0.0
    assert bench_e2e.ratios([_row("edgeserve", "fp32", 1, 0, 10.0)]) == {"fp32": {1: None}}


def test_pass_order_alternates_and_each_system_goes_first_equally() -> None:
    firsts = [bench_e2e.pass_order(p, ci)[0] for ci in range(3) for p in range(2)]
    assert firsts.count("edgeserve") == firsts.count("llamacpp") == 3
    assert bench_e2e.pass_order(0, 0) != bench_e2e.pass_order(1, 0)
    assert set(bench_e2e.pass_order(0, 1)) == {"edgeserve", "llamacpp"}


def test_up_command_selects_each_format_class() -> None:
    argv = bench_e2e.edgeserve_up_command(Path("/m"), 9000, 9001, bench_e2e.FORMATS["int4"][0])
    assert argv[1:4] == ["-m", "ops.cli", "up"]
    tail = " ".join(argv[4:])
    assert "--model /m --served-name smollm2-135m --port 9000 --worker-port 9001" in tail
    assert tail.endswith("--decode-weights int4 --int4-group-size 32")
    # fp32 and bf16 pin the compute dtype and KV format (`up`'s default follows the host: it must not decide)
    assert bench_e2e.FORMATS["fp32"] == (("--dtype", "float32", "--kv-format", "fp32"), "f32")
    assert bench_e2e.FORMATS["bf16"] == (("--dtype", "bfloat16", "--kv-format", "bf16"), "bf16")
    assert bench_e2e.FORMATS["int4"][1] == bench_e2e.FORMATS["int4-head8"][1] == "q4_1"
    assert bench_e2e.FORMATS["int4-head8"][0] == (*bench_e2e.FORMATS["int4"][0], "--lm-head-weights", "int8")
    # the flags `up` is given exist there, with those values
    help_text = subprocess.run([sys.executable, "-m", "ops.cli", "up", "--help"], capture_output=True, text=True,
                               check=True).stdout
    for flag in ("--decode-weights", "--int4-group-size", "--dtype", "--kv-format", "bfloat16", "fp32", "bf16",
                 "--lm-head-weights"):
        assert flag in help_text


def test_run_without_llamacpp_writes_a_report_that_says_so(tmp_path: Path) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", dest="json_path")
    bench_e2e.add_arguments(p)
    args = p.parse_args(["--quick", "--no-llamacpp", "--json", str(tmp_path / "e2e.json")])
    assert bench_e2e.run(args) == 0
    report = json.loads((tmp_path / "e2e.json").read_text())
    assert report["llamacpp"] == {"available": False, "note": "skipped (--no-llamacpp)"}
    assert report["ratio_vs_llamacpp"] is None and report["passes"] == []
    assert "provenance" in report and "machine" in report


def test_omp_wait_policy_is_passive_only_on_a_busy_machine_unless_chosen() -> None:
    assert bench_e2e.omp_wait_policy("auto", 1.6, 2) == "passive"
    assert bench_e2e.omp_wait_policy("auto", 0.4, 2) == "default"
    assert bench_e2e.omp_wait_policy("default", 9.0, 2) == "default"
    assert bench_e2e.omp_wait_policy("passive", 0.0, 2) == "passive"


def test_busy_cpus_sees_work_running_now_and_not_the_last_minute() -> None:
    """A spinning child holds about one CPU while it is measured; once it is gone the machine reads idle
    (the load average would still remember it). `busy_cpus` reads the whole machine, and `make test` runs
    other test files beside this one, so one of three tries must show the difference (a `busy_cpus` that
    remembered the spinner, or missed it, fails all three)."""
    from ops.bench.harness.procs import busy_cpus

    readings = []
    for _ in range(3):
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(0.3)
            spinning = busy_cpus(1.0)
        finally:
            spinner.kill()
            spinner.wait()
        quiet = busy_cpus(1.0)
        readings.append((spinning, quiet))
        if spinning > 0.8 and spinning - quiet > 0.6:
            return
    raise AssertionError(f"(spinning, quiet) CPUs in three tries: {readings}")
