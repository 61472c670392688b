"""`edgeserve bench gateway`'s figures: latency added over the stand-in itself and requests/s against
LiteLLM, per target and setting; against a baseline commit's gateway; the table and the plot."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ops.bench.gateway.load import Row
from ops.bench.harness import plot

__all__ = ["ADDED_P50_TARGET_MS", "compare", "over_floor", "print_over_floor", "target_verdicts", "vs_baseline",
           "print_vs_baseline", "print_table", "plot_rows"]

ADDED_P50_TARGET_MS = 2.0  # the gateway's added p50 at c = 1 with quotas on, streamed and not


def compare(rows: list[Row]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per target and setting: latency added over direct (ms) and requests/s relative to litellm.

    `added_p50_ms` = target p50 - direct p50 (positive: the proxy costs time); likewise p95, p99;
    `added_p50_rounds_ms` is the same difference round by round (rounds of a setting run side by
    side), as (min, max). `rps_ratio_vs_litellm` = target rps / litellm rps (> 1: faster than
    LiteLLM). Entries are None where the other row is missing.
    """
    by = {(r.target, r.key): r for r in rows}
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        direct, litellm = by.get(("direct", r.key)), by.get(("litellm", r.key))
        entry: dict[str, Any] = {"added_p50_ms": None, "added_p95_ms": None, "added_p99_ms": None,
                                 "added_p50_rounds_ms": None, "rps_ratio_vs_litellm": None}
        if direct is not None and r.target != "direct":
            entry["added_p50_ms"] = r.p50_ms - direct.p50_ms
            entry["added_p99_ms"] = r.p99_ms - direct.p99_ms
            if r.p95_ms is not None and direct.p95_ms is not None:
                entry["added_p95_ms"] = r.p95_ms - direct.p95_ms
            paired = [a - b for a, b in zip(r.p50_rounds_ms, direct.p50_rounds_ms)]
            entry["added_p50_rounds_ms"] = (min(paired), max(paired)) if paired else None
        if litellm is not None and litellm.rps > 0:
            entry["rps_ratio_vs_litellm"] = r.rps / litellm.rps
        out.setdefault(r.target, {})[r.key] = entry
    return out


def over_floor(rows: list[Row]) -> dict[str, dict[str, Any]]:
    """Per setting: the pass-through's added p50 over direct (`floor_added_p50_ms`, the framework floor) and each
    edgeserve target's p50 above the pass-through's (`above_floor_p50_ms`), with that difference round by round
    (`above_floor_rounds_ms`: min, max): the gateway's own work, which a slow spell of the machine inflates less
    than its added latency."""
    by = {(r.target, r.key): r for r in rows}
    out: dict[str, dict[str, Any]] = {}
    for (target, key), floor in by.items():
        direct = by.get(("direct", key))
        if target != "passthrough" or direct is None:
            continue
        above, rounds = {}, {}
        for (other, other_key), row in by.items():
            if other_key == key and other.startswith("edgeserve"):
                above[other] = row.p50_ms - floor.p50_ms
                paired = [a - b for a, b in zip(row.p50_rounds_ms, floor.p50_rounds_ms)]
                rounds[other] = (min(paired), max(paired)) if paired else None
        out[key] = {"floor_added_p50_ms": floor.p50_ms - direct.p50_ms, "above_floor_p50_ms": above,
                    "above_floor_rounds_ms": rounds}
    return out


def print_over_floor(floor: dict[str, dict[str, Any]]) -> None:
    """`over_floor`'s figures, one line per setting."""
    for key, e in floor.items():
        spans = {name: "" if r is None else f" [{r[0]:+.2f}, {r[1]:+.2f}]"
                 for name, r in e["above_floor_rounds_ms"].items()}
        above = ", ".join(f"{name} {v:+.2f}{spans[name]}" for name, v in e["above_floor_p50_ms"].items())
        print(f"  {key:<14}pass-through {e['floor_added_p50_ms']:+.2f} ms over direct; above it: {above}")


def target_verdicts(rows: list[Row]) -> dict[str, dict[str, Any]]:
    """The issue's targets with a verdict each, judged round by round (the machine's speed drifts between
    rounds more than a pooled figure shows): "met" when every round meets it, "missed" when none does,
    else "unresolved".

    - `added_p50_le_2ms_c1_nostream` / `_stream`: edgeserve with quotas, p50 minus direct's p50 in the
      same repetition, at most `ADDED_P50_TARGET_MS`;
    - `rps_gt_litellm_<setting>`: edgeserve with quotas serves more requests/s than LiteLLM in each
      repetition (only where LiteLLM ran).
    """
    by = {(r.target, r.key): r for r in rows}
    out: dict[str, dict[str, Any]] = {}

    def judge(name: str, figures: list[float], ok: Callable[[float], bool]) -> None:
        hits = [bool(ok(v)) for v in figures]
        if hits:
            out[name] = {"verdict": "met" if all(hits) else "missed" if not any(hits) else "unresolved",
                         "met": all(hits), "per_round": figures}

    for key in ("c1_nostream", "c1_stream"):
        quota, direct = by.get(("edgeserve+quota", key)), by.get(("direct", key))
        if quota is not None and direct is not None:
            judge(f"added_p50_le_2ms_{key}", [a - b for a, b in zip(quota.p50_rounds_ms, direct.p50_rounds_ms)],
                  lambda v: v <= ADDED_P50_TARGET_MS)
    for (target, key), row in by.items():
        litellm = by.get(("litellm", key))
        if target == "edgeserve+quota" and litellm is not None:
            judge(f"rps_gt_litellm_{key}", [a / b for a, b in zip(row.rps_rounds, litellm.rps_rounds) if b > 0],
                  lambda v: v > 1.0)
    return out


def vs_baseline(rows: list[Row], cmp: dict[str, dict[str, dict[str, Any]]], commit: str
                 ) -> dict[str, dict[str, dict[str, Any]]]:
    """Per tenant kind and setting: this tree over the baseline's gateway.

    `added_p50_ratio` and `cpu_ms_per_request_ratio` compare the pooled figures (all rounds
    together; the CPU is the proxy's alone). On a shared machine whose speed drifts over minutes
    the steadier figures are paired by round: the two gateways of a repetition run back to back in
    the same setting, so `p50_round_ratio` and `cpu_round_ratio` (proxy + Redis CPU per request)
    take the ratio round by round and give its median, min and max over the rounds.
    """
    by = {(r.target, r.key): r for r in rows}
    out: dict[str, dict[str, dict[str, Any]]] = {}
    ratio = lambda a, b: a / b if a is not None and b else None  # noqa: E731
    for kind in ("edgeserve", "edgeserve+quota"):
        for key, entry in cmp.get(kind, {}).items():
            old, new, base = cmp.get(f"{kind}@{commit}", {}).get(key), entry, by.get((f"{kind}@{commit}", key))
            mine = by[(kind, key)]
            out.setdefault(kind, {})[key] = {
                "added_p50_ratio": ratio(new["added_p50_ms"], old and old["added_p50_ms"]),
                "cpu_ms_per_request_ratio": ratio(mine.proxy_cpu_ms_per_request,
                                                  base and base.proxy_cpu_ms_per_request),
                "p50_round_ratio": _paired(mine.p50_rounds_ms, base.p50_rounds_ms if base else []),
                "cpu_round_ratio": _paired(mine.cpu_rounds_ms, base.cpu_rounds_ms if base else [])}
    return out


def _paired(mine: list[float], theirs: list[float]) -> dict[str, float] | None:
    """Median, min and max of mine[i] / theirs[i] over the rounds both have."""
    ratios = sorted(a / b for a, b in zip(mine, theirs) if b > 0)
    if not ratios:
        return None
    return {"median": statistics.median(ratios), "min": ratios[0], "max": ratios[-1], "rounds": len(ratios)}


def print_vs_baseline(vs: dict[str, dict[str, dict[str, Any]]], commit: str) -> None:
    """The paired round-by-round ratios of `vs_baseline`, one line per tenant kind and setting."""
    print(f"this tree / {commit}, paired by round (median [min, max]):")
    for kind, per in vs.items():
        for key, v in per.items():
            parts = [f"{name} {r['median']:.3f}x [{r['min']:.2f}, {r['max']:.2f}]"
                     for name, r in (("p50", v["p50_round_ratio"]), ("cpu/req", v["cpu_round_ratio"])) if r]
            print(f"  {kind:<16}{key:<14}" + "  ".join(parts))


def print_table(rows: list[Row], cmp: dict[str, dict[str, dict[str, Any]]]) -> None:
    width = max(10, *(len(r.target) + 2 for r in rows))
    print(f"{'target':<{width}}{'c':>4} {'stream':<7}{'rps':>9}{'p50 ms':>9}{'p95 ms':>9}{'p99 ms':>9}"
          f"{'ttft p50':>10}{'added p50':>11}{'added p95':>11}{'added p99':>11}{'rps/litellm':>13}"
          f"{'cpu ms/req':>12}{'errors':>8}")
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for r in rows:
        e = cmp[r.target][r.key]
        cpu = None if r.proxy_cpu_ms_per_request is None else (
            r.proxy_cpu_ms_per_request + (r.redis_cpu_ms_per_request or 0.0))
        print(f"{r.target:<{width}}{r.concurrency:>4} {'yes' if r.stream else 'no':<7}{r.rps:>9.1f}"
              f"{r.p50_ms:>9.2f}{fmt(r.p95_ms, '.2f'):>9}{r.p99_ms:>9.2f}{fmt(r.ttft_p50_ms, '.2f'):>10}"
              f"{fmt(e['added_p50_ms'], '+.2f'):>11}{fmt(e['added_p95_ms'], '+.2f'):>11}"
              f"{fmt(e['added_p99_ms'], '+.2f'):>11}{fmt(e['rps_ratio_vs_litellm'], '.2f'):>13}"
              f"{fmt(cpu, '.2f'):>12}{r.errors:>8}")


def plot_rows(rows: list[Row], cmp: dict[str, dict[str, dict[str, Any]]], title: str, path: Path) -> bool:
    plt = plot.pyplot()
    if plt is None:
        return False

    keys = list(dict.fromkeys(r.key for r in rows))
    targets = list(dict.fromkeys(r.target for r in rows))
    palette = ("tab:gray", "tab:olive", "tab:brown", "tab:blue", "tab:cyan", "tab:purple", "tab:pink",
               "tab:orange")
    colours = dict(zip(targets, palette))
    by = {(r.target, r.key): r for r in rows}
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.8 / len(targets)
    for i, t in enumerate(targets):
        xs = [k + (i - (len(targets) - 1) / 2) * width for k in range(len(keys))]
        left.bar(xs, [by[(t, k)].rps if (t, k) in by else 0 for k in keys], width, label=t, color=colours.get(t))
        if t != "direct":
            right.bar(xs, [cmp[t].get(k, {}).get("added_p50_ms") or 0 for k in keys], width, label=t,
                      color=colours.get(t))
    for ax, ylabel in ((left, "requests/s"), (right, "added p50 latency vs direct (ms)")):
        ax.set_xticks(range(len(keys)), keys, rotation=20)
        ax.set_ylabel(ylabel)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend()
    return plot.save(fig, title, path)
