"""Every C kernel of `kernels/cpu/` built for this host before a worker takes its first request.

`CKernel` builds a kernel at its first call and caches the shared object per host, source and
compiler (`kernels/cpu_build.py`). On a host's first start, or after an upgrade changed a source
or a shared header, those first calls fall inside the first request's first step: on a 2-core
Xeon a SmolLM2 worker's first step took 14.5 s instead of 0.13 s, 10.4 s of it `paged_decode.c`
alone. `start_prebuild()` builds them all on helper threads (each build is its own gcc process,
so they run side by side, the largest source first) while the caller loads the model;
`Prebuild.wait()` returns once every kernel is loaded or has failed. A kernel that fails keeps
its reason and its callers take their torch paths, as without the prebuild. Where every kernel
is already cached, the prebuild only loads them (a few milliseconds each).
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait

import kernels
from kernels.cpu_build import CKernel

__all__ = ["cpu_kernels", "Prebuild", "start_prebuild"]


def cpu_kernels() -> list[CKernel]:
    """Every `CKernel` a module `kernels/cpu_*.py` defines at its top level (the shared helper pool too),
    largest source first."""
    found: dict[int, CKernel] = {}
    for info in pkgutil.iter_modules(kernels.__path__):
        if info.name.startswith("cpu_"):
            module = importlib.import_module(f"kernels.{info.name}")
            found.update((id(v), v) for v in vars(module).values() if isinstance(v, CKernel))
    return sorted(found.values(), key=lambda k: k.source.stat().st_size, reverse=True)


class Prebuild:
    """The builds of `kernels`, `workers` at a time, started at construction on threads of their own."""

    def __init__(self, kernels_: list[CKernel], workers: int) -> None:
        self.kernels = kernels_
        self._started = time.perf_counter()
        self._ended: list[float] = []  # when each build ended (list.append is atomic)
        pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="kernel-build")
        self._futures: list[Future[None]] = [pool.submit(self._build, k) for k in kernels_]
        pool.shutdown(wait=False)  # the threads end with their last build

    def _build(self, kernel: CKernel) -> None:
        try:
            kernel.available()
        finally:
            self._ended.append(time.perf_counter())

    def done(self) -> bool:
        """Whether every build has ended."""
        return all(f.done() for f in self._futures)

    def wait(self) -> float:
        """Block until every build has ended; the seconds from the prebuild's start to its last build's end."""
        wait(self._futures)
        for f in self._futures:
            f.result()  # a build's own errors are kept by its kernel; anything else is a bug to surface
        return max(self._ended, default=self._started) - self._started

    def failed(self) -> dict[str, str]:
        """Source name -> why it is unavailable, for the kernels that did not build (after `wait`)."""
        return {k.source.name: k.error for k in self.kernels if k.error is not None}


def start_prebuild(workers: int | None = None) -> Prebuild:
    """Start building every CPU kernel (`cpu_kernels`), `workers` gcc processes at a time (default: the
    CPUs this process may run on)."""
    return Prebuild(cpu_kernels(), workers or len(os.sched_getaffinity(0)))
