"""The handover of a small decode step's threads from torch's OpenMP pool to the C kernels
(`kernels/cpu_threads.py`), alone and in the engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels import cpu_gemv
from kernels.cpu_threads import kernel_threads, torch_single_threaded


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_torch_runs_alone_and_the_kernels_keep_its_count(two_threads) -> None:
    assert kernel_threads() == 2
    with torch_single_threaded():
        assert torch.get_num_threads() == 1 and kernel_threads() == 2
        with torch_single_threaded():  # nested: still one, and leaving it does not restore early
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 1 and kernel_threads() == 2
    assert torch.get_num_threads() == 2 and kernel_threads() == 2
    with pytest.raises(RuntimeError), torch_single_threaded():
        raise RuntimeError("a failed step")
    assert torch.get_num_threads() == 2  # restored on error too


@pytest.mark.skipif(not cpu_gemv.available(), reason=f"bf16 GEMV not built for this CPU: {cpu_gemv.build_error()}")
@pytest.mark.parametrize("dtype,handed_over", [("bfloat16", True), ("float32", False)])
def test_the_engine_hands_over_only_steps_whose_linears_all_run_the_gemv(tiny_chat_dir: Path, two_threads,
                                                                        dtype: str, handed_over: bool) -> None:
    from backend.engine import EngineConfig, LLMEngine
    from backend.sampling_params import SamplingParams

    engine = LLMEngine.from_pretrained(tiny_chat_dir, EngineConfig(dtype=dtype, kv_format="fp32", num_threads=2,
                                                                   kv_cache_bytes=4 << 20, gemm_buckets=()))
    assert engine.runner.gemv_decode is handed_over
    seen: list[tuple[int, int, int]] = []  # (tokens in the step, torch's threads, the kernels' threads)
    run = engine.runner.run

    def recording(batch):
        tokens = len(batch.decode) + sum(n for _, n in batch.prefill)
        seen.append((tokens, torch.get_num_threads(), kernel_threads()))
        return run(batch)

    engine.runner.run = recording
    for i, prompt in enumerate([list(range(10, 30)), [5, 6, 7]]):
        engine.add_request(prompt, SamplingParams(max_tokens=4, temperature=0.0), request_id=f"r{i}")
    while engine.has_work():
        engine.step()
    assert any(t > cpu_gemv.MAX_ROWS for t, _, _ in seen) and any(t <= cpu_gemv.MAX_ROWS for t, _, _ in seen)
    for tokens, torch_threads, kernels in seen:
        small = handed_over and tokens <= cpu_gemv.MAX_ROWS
        assert (torch_threads, kernels) == ((1, 2) if small else (2, 2)), (tokens, torch_threads, kernels)
    assert torch.get_num_threads() == 2


def test_only_a_handover_gives_the_kernels_the_other_cores(two_threads) -> None:
    from kernels.cpu_threads import kernels_own_threads

    assert not kernels_own_threads()
    with torch_single_threaded():
        assert kernels_own_threads()
    assert not kernels_own_threads()
