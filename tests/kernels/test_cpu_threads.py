"""The handover of a small decode step's threads from torch's OpenMP pool to the C kernels
(`kernels/cpu_threads.py`), alone and in the engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels import cpu_gemv
from kernels.cpu_threads import (RUN_OPENMP, RUN_POOL_LINGER, RUN_POOL_SLEEP, kernel_threads, run_mode,
                                 torch_runs_libgomp, torch_single_threaded)


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
@pytest.mark.parametrize("dtype,f32_kernel", [("bfloat16", True), ("float32", True), ("float32", False)])
def test_the_engine_hands_over_only_steps_whose_linears_all_run_the_gemv(tiny_chat_dir: Path, two_threads,
                                                                        monkeypatch: pytest.MonkeyPatch,
                                                                        dtype: str, f32_kernel: bool) -> None:
    """Steps of up to the linears' GEMV rows run torch at one thread; a float32 model whose GEMV does not build
    keeps torch's threads on every step."""
    from backend.engine import EngineConfig, LLMEngine
    from backend.sampling_params import SamplingParams
    from kernels import cpu_gemv_f32

    if not f32_kernel:
        monkeypatch.setattr(cpu_gemv_f32, "available", lambda: False)
    handed_over = dtype == "bfloat16" or (f32_kernel and cpu_gemv_f32.available())
    engine = LLMEngine.from_pretrained(tiny_chat_dir, EngineConfig(dtype=dtype, kv_format="fp32", num_threads=2,
                                                                   kv_cache_bytes=4 << 20, gemm_buckets=()))
    assert engine.runner.gemv_decode is handed_over
    seen: list[tuple[int, int, int]] = []  # (tokens in the step, torch's threads, the kernels' threads)
    run = engine.runner.run

    def recording(batch):
        seen.append((batch.num_tokens, torch.get_num_threads(), kernel_threads()))
        return run(batch)

    engine.runner.run = recording
    limit = cpu_gemv.max_rows() if dtype == "bfloat16" else cpu_gemv_f32.max_rows()
    assert engine.runner.gemv_rows == (limit if handed_over else 0)
    for i, prompt in enumerate([[10 + j % 50 for j in range(limit + 8)], [5, 6, 7]]):
        engine.add_request(prompt, SamplingParams(max_tokens=4, temperature=0.0), request_id=f"r{i}")
    while engine.has_work():
        engine.step()
    assert any(t > limit for t, _, _ in seen) and any(t <= limit for t, _, _ in seen)
    for tokens, torch_threads, kernels in seen:
        small = handed_over and tokens <= limit
        assert (torch_threads, kernels) == ((1, 2) if small else (2, 2)), (tokens, torch_threads, kernels)
    assert torch.get_num_threads() == 2


def test_only_a_handover_gives_the_kernels_the_other_cores(two_threads) -> None:
    from kernels.cpu_threads import kernels_own_threads

    assert not kernels_own_threads()
    with torch_single_threaded():
        assert kernels_own_threads()
    assert not kernels_own_threads()


def test_kernels_share_out_on_torchs_openmp_pool_outside_a_handover(two_threads,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EDGESERVE_KERNEL_OPENMP", raising=False)
    outside = RUN_OPENMP if torch_runs_libgomp() else RUN_POOL_SLEEP
    assert run_mode() == outside
    with torch_single_threaded():
        assert run_mode() == RUN_POOL_LINGER
    monkeypatch.setenv("EDGESERVE_KERNEL_OPENMP", "0")
    assert run_mode() == RUN_POOL_SLEEP


def test_a_kernel_built_with_openmp_shares_torchs_libgomp() -> None:
    """The PyPI torch this project installs runs libgomp; a kernel built with -fopenmp must resolve its
    libgomp.so.1 to torch's copy, not load a second runtime with a pool of its own."""
    import kernels.cpu_silu_mul as silu

    assert torch_runs_libgomp()
    assert silu.available()
    with open("/proc/self/maps") as maps:
        gomps = {line.split()[-1] for line in maps if "libgomp" in line}
    assert len(gomps) == 1 and "torch" in next(iter(gomps)), gomps


def test_a_yielding_main_thread_starts_no_openmp_pool_and_the_engine_thread_owns_it() -> None:
    """In a fresh process (this one already has pools): after `yield_openmp_to_engine_thread`, parallel torch ops on
    the main thread start no OpenMP worker, and a thread that sets the returned count starts the only pool."""
    import os
    import subprocess
    import sys

    script = """
import os, threading, torch
from kernels.cpu_threads import yield_openmp_to_engine_thread
tasks = lambda: len(os.listdir('/proc/self/task'))
before = tasks()
count = yield_openmp_to_engine_thread(2)
a = torch.ones(1 << 20)
for _ in range(3):
    a.add_(1)  # parallel above torch's grain size, were the thread at 2
on_main = tasks() - before
seen = []
def engine():
    torch.set_num_threads(count)
    a.add_(1)
    seen.append((torch.get_num_threads(), tasks() - before))
t = threading.Thread(target=engine)
t.start(); t.join()
print(count, torch.get_num_threads(), on_main, *seen[0])
"""
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert out.returncode == 0, out.stderr
    count, main_threads, on_main, engine_threads, pool_workers = map(int, out.stdout.split())
    assert (count, main_threads, on_main, engine_threads) == (2, 1, 0, 2)
    assert pool_workers == 2  # the engine thread itself and the one worker of its pool


def test_the_async_engine_sets_its_thread_count_on_its_own_thread(tiny_chat_dir: Path) -> None:
    import asyncio

    from backend.async_engine import AsyncEngine
    from backend.engine import EngineConfig, LLMEngine
    from backend.sampling_params import SamplingParams

    before = torch.get_num_threads()
    engine = LLMEngine.from_pretrained(tiny_chat_dir, EngineConfig(dtype="float32", kv_format="fp32",
                                                                   kv_cache_bytes=4 << 20, gemm_buckets=()))
    seen: list[int] = []
    step = engine.step

    def recording():
        seen.append(torch.get_num_threads())
        return step()

    engine.step = recording
    torch.set_num_threads(1)  # the main thread yields, as `edgeserve serve` does
    try:
        async_engine = AsyncEngine(engine, threads=2)
        async_engine.start()

        async def go() -> None:
            async for _ in async_engine.generate(list(range(10, 20)), SamplingParams(max_tokens=3, temperature=0.0)):
                pass

        asyncio.run(go())
        async_engine.shutdown()
        assert seen and set(seen) == {2} and torch.get_num_threads() == 1  # the engine thread's count, not main's
    finally:
        torch.set_num_threads(before)
