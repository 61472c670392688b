"""Who owns the CPU's threads during a decode step of a few rows: the C kernels, not torch's OpenMP pool.

At a handful of rows every bfloat16 linear runs the C GEMV (`kernels/cpu_gemv.py`), whose helper
threads claim chunks of the weight rows. torch's own OpenMP workers, once woken by any parallel
torch op of the step (a copy, the sampler's argmax over the vocabulary), spin for milliseconds
after it (libgomp's default wait policy) and share the cores with those helpers: measured with
`edgeserve bench token-profile --quick` on a 2-core Intel Xeon VM (SmolLM2, bfloat16, c = 1), a
step took 47-63 ms with torch at 2 threads against 40 ms with `OMP_WAIT_POLICY=PASSIVE`.
A passive policy for the whole process cost the c = 32 step 10-60% (157-181 against 174-295 ms:
its GEMMs wake sleeping workers hundreds of times a step), so instead torch runs at one thread
for exactly the steps whose linears all take the GEMV, and the C kernels keep the thread count
torch had (`kernel_threads`). Larger steps keep torch's pool as it was.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

__all__ = ["kernel_threads", "kernels_own_threads", "torch_single_threaded"]

_state = threading.local()


def kernel_threads() -> int:
    """Threads a C kernel may use now: torch's count, or the count torch had before `torch_single_threaded`."""
    return getattr(_state, "threads", None) or torch.get_num_threads()


def kernels_own_threads() -> bool:
    """Whether this thread is inside `torch_single_threaded`: no OpenMP worker of torch's is spinning on the
    other cores, so a C kernel's helpers have them to themselves."""
    return getattr(_state, "threads", None) is not None


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
