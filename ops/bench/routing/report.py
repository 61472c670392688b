"""`edgeserve bench routing`'s table and plot: per policy the hit rate, TTFT, throughput and the load on
each worker."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ops.bench.harness import plot
from ops.bench.routing.measures import PolicySummary

__all__ = ["print_table", "plot_summaries"]


def print_table(summaries: dict[str, PolicySummary], details: dict[str, dict[str, Any]]) -> None:
    print(f"{'policy':<14}{'hit rate':>9}{'(workers)':>10}{'TTFT p50':>10}{'TTFT p95':>10}{'req/s':>7}"
          f"{'out tok/s':>10}  {'requests per worker':<22}{'max/mean':>9}{'same wkr':>9}{'errors':>7}")
    for p, s in summaries.items():
        loads = " ".join(f"{n:>3}" for n in s.requests_per_worker.values())
        print(f"{p:<14}{s.hit_rate:>9.1%}{details[p]['hit_rate_workers']:>10.1%}{s.ttft_p50_s:>9.2f}s"
              f"{s.ttft_p95_s:>9.2f}s{s.requests_per_s:>7.2f}{s.output_tok_s:>10.1f}  {loads:<22}"
              f"{s.max_over_mean_load:>9.2f}{s.same_worker_rate:>9.0%}{s.errors:>7}")


def plot_summaries(summaries: dict[str, PolicySummary], path: Path, title: str) -> bool:
    plt = plot.pyplot()
    if plt is None:
        return False

    names = list(summaries)
    colours = {"prefix": "tab:blue", "round-robin": "tab:orange", "least-loaded": "tab:green"}
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(14, 4.2))
    a.bar(names, [100 * summaries[p].hit_rate for p in names], color=[colours[p] for p in names])
    a.set_ylabel("prefix cache hit rate (% of prompt tokens)")
    xs = range(len(names))
    b.bar([x - 0.2 for x in xs], [summaries[p].ttft_p50_s for p in names], 0.4, label="p50", color="tab:gray")
    b.bar([x + 0.2 for x in xs], [summaries[p].ttft_p95_s for p in names], 0.4, label="p95", color="tab:red")
    b.set_xticks(list(xs), names)
    b.set_ylabel("TTFT (s)")
    b.legend()
    workers = list(next(iter(summaries.values())).requests_per_worker) if summaries else []
    width = 0.8 / max(1, len(names))
    for i, p in enumerate(names):
        c.bar([w + (i - (len(names) - 1) / 2) * width for w in range(len(workers))],
              [summaries[p].requests_per_worker[w] for w in workers], width, label=p, color=colours[p])
    c.set_xticks(range(len(workers)), workers)
    c.set_ylabel("requests per worker")
    c.legend()
    for ax in (a, b, c):
        ax.grid(True, axis="y", alpha=0.3)
    return plot.save(fig, title, path)
