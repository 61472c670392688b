"""`bench cpu-kernels`' timer: the C kernel and the torch path it replaces taking turns, pass by pass."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from ops.bench.harness.stats import rotated

__all__ = ["alternate", "in_step", "result_row", "SETTLE_S"]

# a pause before each timed pass: torch's OpenMP workers spin for milliseconds after a parallel region
# (kernels/cpu_threads.py), which would slow whichever pass follows a torch pass
SETTLE_S = 0.05


def alternate(calls: dict[str, Callable[[], Any]], reps: int, settle_s: float = SETTLE_S) -> dict[str, list[float]]:
    """Seconds of each call in each of `reps` rounds (after one untimed round), the calls taking turns (who goes
    first rotates) with a pause of `settle_s` before each timed call."""
    for call in calls.values():
        call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(reps):
        for name in rotated(list(calls), r):
            time.sleep(settle_s)
            t = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - t)
    return times


def in_step(fn: Callable[[], Any]) -> Callable[[], Any]:
    """fn run as a decode step runs the C kernels: torch's threads handed over to their pool."""
    from kernels.cpu_threads import torch_single_threaded

    def call() -> Any:
        with torch_single_threaded():
            return fn()
    return call


def result_row(key: str, section: str, kernel: str, shape: str, runs: dict[str, list[float]], work: float = 0.0,
               unit: str = "") -> dict[str, Any]:
    """One result from `alternate`'s runs: median times, their ratio and the spread of the rounds' own ratios;
    `key` names it in the headline; `work` (FLOP or bytes) over the median times gives the rates."""
    c, t = statistics.median(runs["c"]), statistics.median(runs["torch"])
    per_round = [b / a for a, b in zip(runs["c"], runs["torch"], strict=True)]
    out = {"key": key, "section": section, "kernel": kernel, "shape": shape, "c_ms": c * 1e3, "torch_ms": t * 1e3,
           "torch_over_c": t / c, "torch_over_c_rounds": [min(per_round), max(per_round)],
           "c_ms_runs": [x * 1e3 for x in runs["c"]], "torch_ms_runs": [x * 1e3 for x in runs["torch"]]}
    if unit:
        out.update({"unit": unit, "c_rate": work / c / 1e9, "torch_rate": work / t / 1e9})
    return out
