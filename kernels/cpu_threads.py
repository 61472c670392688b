"""Who owns the CPU's threads: in a worker, the engine thread owns torch's OpenMP pool; in a step of up to
`cpu_gemv.max_rows()` rows, the C kernels own the cores, not that pool.

At those row counts every bfloat16 linear runs the C GEMV (`kernels/cpu_gemv.py`), whose helper
threads claim chunks of the weight rows. torch's own OpenMP workers, once woken by any parallel
torch op of the step (a copy, the sampler's argmax over the vocabulary), spin for milliseconds
after it (libgomp's default wait policy) and share the cores with those helpers: measured with
`edgeserve bench token-profile --quick` on a 2-core Intel Xeon VM (SmolLM2, bfloat16, c = 1), a
step took 47-63 ms with torch at 2 threads against 40 ms with `OMP_WAIT_POLICY=PASSIVE`.
A passive policy for the whole process cost the c = 32 step 10-60% (157-181 against 174-295 ms:
its GEMMs wake sleeping workers hundreds of times a step), so instead torch runs at one thread
for exactly the steps whose linears all take the GEMV, and the C kernels keep the thread count
torch had (`kernel_threads`). Larger steps keep torch's pool as it was, and the C kernels between their
GEMMs (RMSNorm, SwiGLU, RoPE, the KV store, the attention) share out their chunks on that pool too, as
OpenMP regions (`run_mode`, `kernels/cpu/pool.h`): its workers are awake from the GEMM before, where the
helper threads would sleep between calls and wake late. Measured on a 2-core Xeon with AMX (SmolLM2,
bfloat16, lone prompts of 130-600 tokens): TTFT 1.14x faster than on the helper threads.

One thread of a process owns torch's OpenMP pool. libgomp gives every thread that starts a
parallel region a pool of its own, and once the process holds more OpenMP threads than CPUs it
stops spinning between regions (a throttled spin of 100 iterations; `GOMP_SPINCOUNT` and
`OMP_WAIT_POLICY` do not change that), so every region wakes its workers from a futex. A worker
process loads the model on its main thread and steps the engine on another: measured on a 2-core
Intel Xeon VM, a 1 MB `torch.add` at 2 threads took 34 µs on the main thread and 126-180 µs on a
second thread once the main thread had run one parallel region (38-48 µs before it had), an INT4
GEMM 34 against 111-130 µs; the served INT4 worker's token took 44-50 ms against a 20 ms step in
process. `yield_openmp_to_engine_thread` keeps the main thread at one thread (it never starts a
pool) and hands the count to the engine thread, which sets it when it starts.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

import torch

__all__ = ["kernel_threads", "kernels_own_threads", "run_mode", "torch_runs_libgomp", "torch_single_threaded",
           "yield_openmp_to_engine_thread", "RUN_POOL_SLEEP", "RUN_POOL_LINGER", "RUN_OPENMP"]

_state = threading.local()

# how a C kernel call shares out its chunks (`kernels/cpu/pool.h`, the kernels' `linger` argument)
RUN_POOL_SLEEP, RUN_POOL_LINGER, RUN_OPENMP = 0, 1, 2


def _libgomp_mapped() -> bool:
    """Whether GNU libgomp is mapped into this process and no other OpenMP runtime is (Linux; False elsewhere)."""
    try:
        with open("/proc/self/maps") as maps:
            names = {line.rsplit("/", 1)[-1].strip() for line in maps if "/" in line}
    except OSError:
        return False
    return any(n.startswith("libgomp") for n in names) and not any(n.startswith(("libiomp", "libomp")) for n in names)


_TORCH_GOMP = _libgomp_mapped()  # read once torch is imported (above) and before any kernel built with -fopenmp loads


def torch_runs_libgomp() -> bool:
    """Whether torch's OpenMP runtime is GNU libgomp, the one a kernel built with `-fopenmp` then shares (read when
    this module was imported, right after torch)."""
    return _TORCH_GOMP


def kernel_threads() -> int:
    """Threads a C kernel may use now: torch's count, or the count torch had before `torch_single_threaded`."""
    return getattr(_state, "threads", None) or torch.get_num_threads()


def kernels_own_threads() -> bool:
    """Whether this thread is inside `torch_single_threaded`: no OpenMP worker of torch's is spinning on the
    other cores, so a C kernel's helpers have them to themselves."""
    return getattr(_state, "threads", None) is not None


def run_mode() -> int:
    """How a C kernel called now shares out its chunks: inside `torch_single_threaded` on the shared pool with its
    helpers spinning after the call (`RUN_POOL_LINGER`: the next kernel call is near, nothing else wants the
    cores); else on torch's OpenMP pool (`RUN_OPENMP`: torch's GEMMs run on all threads in this step, so its
    workers are awake, where the shared pool's would sleep between calls) where torch runs libgomp, unless
    `EDGESERVE_KERNEL_OPENMP=0`; else the shared pool with its helpers asleep after the call."""
    if kernels_own_threads():
        return RUN_POOL_LINGER
    if _TORCH_GOMP and os.environ.get("EDGESERVE_KERNEL_OPENMP", "1") != "0":
        return RUN_OPENMP
    return RUN_POOL_SLEEP


@contextlib.contextmanager
def torch_single_threaded() -> Iterator[None]:
    """torch at one thread for the block (no OpenMP region, so no worker left spinning), the C kernels at
    the threads torch had; restored after, also on error. Nested uses keep the outer count."""
    threads = torch.get_num_threads()
    if getattr(_state, "threads", None) is not None or threads <= 1:  # nested, or nothing to hand over
        yield
        return
    _state.threads = threads
    torch.set_num_threads(1)
    try:
        yield
    finally:
        _state.threads = None
        torch.set_num_threads(threads)


def yield_openmp_to_engine_thread(threads: int | None) -> int:
    """Run torch at one thread on the calling thread from now on (a server's main thread: model loading, HTTP),
    so that it never starts an OpenMP pool; returns the count the engine thread is to set (`threads`, else
    torch's default). Call it before the first parallel torch op of the process."""
    count = threads or torch.get_num_threads()
    torch.set_num_threads(1)
    return count
