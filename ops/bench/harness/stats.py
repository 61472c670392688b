"""Statistics the benchmarks share: nearest-rank percentiles, the spread of repeated measurements,
Latin rotations (so no system always runs first) and a block bootstrap over paired steps.

Percentiles are nearest rank, not interpolated: a reported p95 is a latency some request saw.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

__all__ = ["percentile", "rotated", "spread", "ratio", "block_bootstrap_ci", "median_ratio", "throughput_overhead",
           "verdict"]

T = TypeVar("T")


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]); NaN for no values."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def rotated(items: Sequence[T], r: int) -> list[T]:
    """`items` rotated left by `r`: round r of a Latin rotation (over len(items) rounds every item
    takes every position once)."""
    if not items:
        return []
    k = r % len(items)
    return [*items[k:], *items[:k]]


def spread(values: list[float]) -> dict[str, float]:
    """Median, min and max of repeated measurements."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def ratio(a: float, b: float) -> float:
    """a / b, NaN when b is 0."""
    return a / b if b else float("nan")


def block_bootstrap_ci(strata: Sequence[tuple[Sequence[float], Sequence[float]]],
                       statistic: Callable[[np.ndarray, np.ndarray], float], block: int = 4,
                       resamples: int = 2000, level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile interval of `statistic(a, b)` under a stratified circular block bootstrap.

    `strata` holds paired series (a[i] and b[i] measured side by side); each stratum (a
    repetition) is resampled on its own, in runs of `block` consecutive pairs (wrapping
    round at the end, so the first and last pairs are drawn as often as the rest), so a
    burst that spans several steps stays one unit. Pairs stay together."""
    rng = np.random.default_rng(seed)
    picks = []
    for a, b in strata:
        n = min(len(a), len(b))
        if n == 0:
            continue
        width = min(block, n)
        starts = rng.integers(0, n, size=(resamples, -(-n // width)))
        picks.append((np.asarray(a[:n], float), np.asarray(b[:n], float),
                      ((starts[:, :, None] + np.arange(width)) % n).reshape(resamples, -1)[:, :n]))
    if not picks:
        return float("nan"), float("nan")
    values = [statistic(np.concatenate([a[idx[r]] for a, _, idx in picks]),
                        np.concatenate([b[idx[r]] for _, b, idx in picks])) for r in range(resamples)]
    lo, hi = np.quantile(values, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def median_ratio(a: Sequence[float], b: Sequence[float]) -> dict[str, Any]:
    """The median of a[i] / b[i] over paired measurements (lengths, rounds), with a 95% bootstrap interval
    (the pairs resampled): {"median", "ci95": [lo, hi]}."""
    ci = block_bootstrap_ci([(a, b)], lambda x, y: float(np.median(x / y)), block=1)
    return {"median": statistics.median(x / y for x, y in zip(a, b)), "ci95": list(ci)}


def throughput_overhead(a: np.ndarray, b: np.ndarray) -> float:
    """Percent of B's throughput that A loses, from paired step seconds (same tokens in both)."""
    return 100.0 * (1.0 - float(b.sum()) / float(a.sum()))


def verdict(ci95: Sequence[float], limit: float = 1.0) -> str:
    """"met" when the whole interval lies under `limit`, "missed" when it lies above, else "unresolved"."""
    lo, hi = ci95
    return "met" if hi < limit else "missed" if lo > limit else "unresolved"
