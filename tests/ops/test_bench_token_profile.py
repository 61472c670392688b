"""`edgeserve bench token-profile`: the split adds up, and a real run on a tiny model fills every part."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ops.bench.token_profile import categorise


def test_categorise_splits_the_wall_time_and_keeps_the_rest_as_python() -> None:
    self_us = {"aten::mm": 600.0, "mkl::_mkl_linear": 100.0, "aten::rms_norm": 50.0, "aten::add_": 25.0}
    split = categorise(self_us, attention_us=80.0, wall_us=1000.0)
    assert split == {"linear": 700.0, "attention": 80.0, "other_ops": 75.0, "python": 145.0}
    assert categorise(self_us, 0.0, 500.0)["python"] == 0.0  # profiled ops past the wall time: no negative rest
    with_gemv = categorise(self_us, attention_us=80.0, wall_us=1000.0, gemv_us=90.0)  # the C GEMV is linear time
    assert with_gemv["linear"] == 790.0 and with_gemv["python"] == 55.0


@pytest.mark.parametrize("dtype,kv", [("float32", "fp32"), ("float32", "fp8_e4m3"), ("bfloat16", "bf16")])
def test_a_run_on_a_tiny_model_accounts_for_the_step(tiny_chat_dir: Path, tmp_path: Path, dtype: str, kv: str) -> None:
    import argparse

    from ops.bench import token_profile

    out = tmp_path / "tp.json"
    p = argparse.ArgumentParser()
    token_profile.add_arguments(p)
    args = p.parse_args(["--model", str(tiny_chat_dir), "--dtype", dtype, "--kv-format", kv, "--steps", "4",
                         "--concurrency", "2", "--threads", "1"])
    args.quick, args.json_path = True, str(out)
    assert token_profile.run(args) == 0
    report = json.loads(out.read_text())
    parts = report["per_step_ms"]
    assert parts["linear"] > 0 and parts["other_ops"] > 0  # the GEMMs and the elementwise ops were seen
    from kernels.cpu_paged_attention import available

    assert (parts["attention"] > 0) == available()  # the C kernel's calls were timed when it runs
    from backend.linear import bf16_gemv_available
    from kernels import cpu_gemv_f32

    gemv_runs = bf16_gemv_available() if dtype == "bfloat16" else cpu_gemv_f32.available()
    assert (report["gemv_ms"] > 0) == gemv_runs  # the bf16 or float32 GEMV's calls were timed, as linear time
    if gemv_runs:
        assert parts["linear"] >= report["gemv_ms"]
    from kernels.cpu_decode_layers import available as fused_available
    from kernels.cpu_decode_layers import float32_available

    if gemv_runs and fused_available() and (dtype == "bfloat16" or float32_available()):
        # every decode step ran its layers in one C call, timed from inside
        assert report["fused_decode_steps"] == 8
        assert report["c_kernels_plain_ms"]["fused gemv"] > 0 and report["c_kernels_plain_ms"]["fused attention"] > 0
        assert parts["linear"] >= report["gemv_ms"] + report["fused_ms"]["gemv"] > report["gemv_ms"]
        assert parts["attention"] == pytest.approx(report["fused_ms"]["attention"], rel=1e-6)
    else:
        assert report["fused_decode_steps"] == 0
    assert sum(parts.values()) == pytest.approx(report["step_ms"], rel=1e-6)
    assert report["steps"] == 4 and report["concurrency"] == 2 and report["kv_format"] == kv
    assert report["provenance"]["commit"]


def test_long_prompts_are_computed_before_the_timed_decode_steps(tiny_chat_dir: Path, tmp_path: Path) -> None:
    """`--prompt-tokens`: four 300-token prompts take more than one step of prompt chunks, in which the requests
    already prefilled decode beside them; the timed windows start once every prompt is computed (before, a long
    prompt's requests could run out of tokens first, and the plain window timed no decode step at all)."""
    import argparse

    from ops.bench import token_profile

    out = tmp_path / "tp.json"
    p = argparse.ArgumentParser()
    token_profile.add_arguments(p)
    args = p.parse_args(["--model", str(tiny_chat_dir), "--dtype", "float32", "--kv-format", "fp32", "--steps", "4",
                         "--concurrency", "4", "--threads", "1", "--prompt-tokens", "300"])
    args.quick, args.json_path = True, str(out)
    assert token_profile.run(args) == 0
    report = json.loads(out.read_text())
    assert report["prompt_tokens"] == 300 and report["plain_step_ms"] > 0 and report["step_ms"] > 0
    from backend.engine import EngineConfig

    assert 4 * 300 > EngineConfig().max_num_batched_tokens  # the prompts did take several steps


def test_the_windows_hold_every_request_after_long_prompts(tiny_chat_dir: Path, tmp_path: Path) -> None:
    """Prompts that take many steps to prefill (a step carrying decode rows is capped) while the first requests
    decode all along: the requests' max_tokens must still cover both windows, or a window would time fewer than
    c requests (the run raises SystemExit then). A budget of one prefill chunk a step, as the bench assumed
    before, gave 39 tokens where the first of these requests needs ~45 on a CPU whose GEMV caps mixed steps
    (it decodes ~33 while the others prefill)."""
    import argparse

    from ops.bench import token_profile

    p = argparse.ArgumentParser()
    token_profile.add_arguments(p)
    args = p.parse_args(["--model", str(tiny_chat_dir), "--dtype", "bfloat16", "--kv-format", "bf16", "--steps", "4",
                         "--concurrency", "16", "--prompt-tokens", "300", "--threads", "1"])
    args.quick, args.json_path = True, str(tmp_path / "tp.json")
    assert token_profile.run(args) == 0
    assert json.loads((tmp_path / "tp.json").read_text())["concurrency"] == 16


def test_the_prefill_bound_covers_the_engines_steps(tiny_chat_dir: Path) -> None:
    """`_prefill_steps_bound` against the steps an engine with the defaults takes to compute c prompts."""
    from backend.engine import EngineConfig, LLMEngine
    from backend.sampling_params import SamplingParams
    from ops.bench.token_profile import _prefill_steps_bound

    engine = LLMEngine.from_pretrained(tiny_chat_dir, EngineConfig(dtype="bfloat16", kv_format="bf16",
                                                                   kv_cache_bytes=1 << 26))
    c, prompt_tokens = 16, 300
    for i in range(c):
        engine.add_request([(7 * i + j) % 1000 + 10 for j in range(prompt_tokens)],
                           SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
    steps = 0
    while engine.scheduler.queued_prefill_tokens() or engine.scheduler.waiting:
        engine.step()
        steps += 1
    assert c * prompt_tokens // EngineConfig().max_num_batched_tokens < steps <= _prefill_steps_bound(c, prompt_tokens)
