"""`edgeserve bench pd`'s figures from request records: token gaps inside a measured window (worker and
client clocks), TTFT and TPOT percentiles pooled over windows, tokens per second, the JSON's compact
form of a round, and a target's verdict (on a figure, or on a paired ratio's 95% interval)."""

from __future__ import annotations

from typing import Any

from ops.bench.harness.stats import percentile
from ops.bench.pd.client import RequestRecord

__all__ = ["Window", "token_gaps", "window_gaps", "latency_stats", "window_tok_s", "compact", "check", "check_paired"]


def token_gaps(times: list[float]) -> list[float]:
    """Seconds between consecutive tokens of one request."""
    return [b - a for a, b in zip(times, times[1:])]


def window_gaps(rec: RequestRecord, start: float, end: float, clock: str = "worker") -> list[float]:
    """Gaps before each token of `rec` that reached the client in [start, end]; measured on the
    worker's per-token times ("worker") or on the client's arrival clock ("client")."""
    times = rec.worker_times if clock == "worker" else rec.arrivals
    return [times[i] - times[i - 1] for i in range(1, len(times)) if start <= rec.arrivals[i] <= end]


Window = tuple[list[RequestRecord], float, float]  # one round's records and its measured window [start, end]


def latency_stats(kind: str, *windows: Window) -> dict[str, Any]:
    """Of the `kind` requests, pooled over windows: TTFT (client clock) of those sent in their window
    (`measured`), and TPOT: the gaps before every token that reached the client inside its window
    (worker clock; `tpot_client_*` on the arrival clock), whenever its request was sent."""
    sent = [r for recs, _, _ in windows for r in recs if r.kind == kind and r.measured]
    ttfts = [r.ttft_s for r in sent if r.ttft_s is not None]
    gaps, client_gaps = [], []
    for recs, start, end in windows:
        for r in recs:
            if r.kind == kind:
                gaps += window_gaps(r, start, end)
                client_gaps += window_gaps(r, start, end, "client")
    worker_ttfts = [r.worker_ttft_s for r in sent if r.worker_ttft_s is not None]
    return {"requests": len(ttfts), "finished": sum(r.ok for r in sent),
            "errors": sum(r.error is not None for r in sent),
            "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p95_s": percentile(ttfts, 0.95),
            "tpot_p50_s": percentile(gaps, 0.5), "tpot_p95_s": percentile(gaps, 0.95),
            "tpot_client_p50_s": percentile(client_gaps, 0.5), "tpot_client_p95_s": percentile(client_gaps, 0.95),
            "worker_ttft_p50_s": percentile(worker_ttfts, 0.5), "gaps": len(gaps)}


def window_tok_s(records: list[RequestRecord], start: float, end: float) -> float:
    """Tokens (of any request) that reached the client in [start, end], per second."""
    return sum(start <= t <= end for r in records for t in r.arrivals) / (end - start)


def compact(records: list[RequestRecord], t0: float) -> list[dict[str, Any]]:
    """Every request of a round for the JSON: times in s after t0 (the window's start), gaps in ms (worker clock)."""
    r3 = lambda v: None if v is None else round(v, 3)  # noqa: E731
    return [{"kind": r.kind, "measured": r.measured, "sent_s": r3(r.sent - t0), "ttft_s": r3(r.ttft_s),
             "worker_ttft_s": r3(r.worker_ttft_s), "first_arrival_s": r3(r.arrivals[0] - t0) if r.arrivals else None,
             "finish": r.finish_reason, "error": r.error,
             "gaps_ms": [round(1e3 * g, 1) for g in token_gaps(r.worker_times)]}
            for r in records]


def check(name: str, value: float, rule: str, threshold: float) -> dict[str, Any]:
    """A target: `value rule threshold` with rule one of "<", "<=", ">="; NaN never meets it."""
    met = {"<": value < threshold, "<=": value <= threshold, ">=": value >= threshold}[rule]
    return {"name": name, "value": value, "rule": rule, "threshold": threshold, "met": bool(met)}


def check_paired(name: str, paired: dict[str, Any], rule: str, threshold: float) -> dict[str, Any]:
    """A target on a paired ratio (`harness.stats.median_ratio`: {"median", "ci95"}): "met" when the whole
    95% interval meets `value rule threshold`, "missed" when none of it does, else "unresolved" (a few pairs
    of a noisy figure cannot tell); ``met`` only for "met"."""
    lo, hi = paired["ci95"]
    ok = {"<": lambda v: v < threshold, "<=": lambda v: v <= threshold, ">=": lambda v: v >= threshold}[rule]
    word = "met" if ok(lo) and ok(hi) else "missed" if not (ok(lo) or ok(hi)) else "unresolved"
    return {"name": name, "value": paired["median"], "ci95": [lo, hi], "rule": rule, "threshold": threshold,
            "verdict": word, "met": word == "met"}
