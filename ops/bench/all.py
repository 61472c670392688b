"""Every benchmark's quick run, one after another, and one summary table (`make bench`).

Each benchmark in `ops.bench.BENCHES` runs as its own child process
(``python -m ops.cli bench NAME --quick --json DIR/NAME.json``, its output in
DIR/NAME.log), and so does each of `VARIANTS` (a benchmark's quick run with arguments of its own, right
after it: ``token-profile-long``, the decode step at c = 32 over 1,000-token contexts, where attention
is about half of it), in its own process group, so one that crashes, runs out of memory or
hangs past ``--timeout`` is reported as failed, whatever it started (workers, a
gateway, Redis) is stopped with it (`stop_group`), and the next one still runs. They run strictly one after
another: two benchmarks at once would measure each other. Before each one the runner waits (up to
`IDLE_WAIT_S`) until fewer than `IDLE_BUSY_CPUS` CPUs are busy, so what the last one left behind
(a server still exiting, a spinning thread) is gone, and the table's last column gives the busy CPUs
it measured then (a figure above the threshold: the benchmark started on a busy machine).

The summary (JSON at ``--json``, markdown beside it with the ``.md`` suffix) has one
row per benchmark: its status (ok; ok with the parts it skipped and why, from the report's
``skipped``; failed with the exit status; timed out; or ran without writing a report), wall
seconds, the commit its report recorded (with "+dirty" when the tree had uncommitted changes),
its headline figures (the report's ``headline`` when it has one, else the keys listed in
`HEADLINE_KEYS`) and its target verdicts, read from whichever shape its ``targets`` take (`targets_of`).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ops.bench.harness.procs import stop_group, wait_idle

__all__ = ["add_arguments", "run", "main", "BenchOutcome", "targets_of", "headline_of", "run_one",
           "summary_markdown", "selected", "run_order", "HEADLINE_KEYS", "VARIANTS"]

# figures worth a glance, for reports without a "headline" of their own (dotted: one level down)
HEADLINE_KEYS: dict[str, list[str]] = {
    "kv-capacity": ["capacity_ratio", "throughput_ratio_fp8_over_bf16", "ppl_relative_fp8_vs_bf16"],
    "weights": ["ratios"],
    "moe": ["ratios"],
    "mla": ["ratios"],
    "structured": ["overhead_pct", "mask_us_mean", "valid_rate"],
    "tp": ["step_ms"],
    "pd": ["ttft_p50_s"],
    "soak": ["total_s"],
}
PART_OF = {"e2e": "engine"}  # benchmarks another one already runs (bench engine ends with bench e2e)
# a row of its own -> (the benchmark, its arguments), run right after that benchmark
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "token-profile-long": ("token-profile", ["--concurrency", "32", "--prompt-tokens", "1000"]),
}
MAX_FIGURES = 8  # per benchmark in the table (the JSON keeps them all)
IDLE_BUSY_CPUS = 0.25  # a benchmark starts once fewer CPUs than this are busy over a second ...
IDLE_WAIT_S = 30.0  # ... or after this long, with the busy figure in its row


@dataclass
class BenchOutcome:
    name: str
    status: str  # "ok" | "ok; skipped PART (why), ..." | "failed (exit N)" | "timed out" | "no report"
    seconds: float
    command: list[str]
    report_path: str
    log_path: str
    commit: str | None = None
    dirty: bool | None = None
    headline: dict[str, Any] = field(default_factory=dict)
    targets: dict[str, str] = field(default_factory=dict)  # name -> "met" | "missed" | "unresolved" ...
    busy_cpus_before: float | None = None  # CPUs busy (every process) over the second before it started


def run_order(names: list[str]) -> list[str]:
    """`names` (registry order) with each of `VARIANTS` right after the benchmark it runs."""
    return [x for n in names for x in (n, *(v for v, (bench, _) in VARIANTS.items() if bench == n))]


def selected(names: list[str], only: str | None, skip: str | None) -> list[str]:
    """The benchmarks to run, in registry order: `only` (comma-separated) if given, minus `skip`; an
    unknown name is an error, so a typo never silently runs nothing."""
    wanted = [n.strip() for n in only.split(",") if n.strip()] if only else list(names)
    dropped = [n.strip() for n in skip.split(",") if n.strip()] if skip else []
    unknown = sorted(set(wanted + dropped) - set(names))
    if unknown:
        raise ValueError(f"unknown benchmarks {unknown}; choose from {', '.join(names)}")
    return [n for n in names if n in wanted and n not in dropped]


def targets_of(report: dict[str, Any]) -> dict[str, str]:
    """Target name -> verdict ("met", "missed", or the report's own word, e.g. "unresolved" for an
    interval that straddles the limit), from the shapes benchmarks use: {name: bool},
    {name: {..., "met"[, "verdict"]}}, [{"target" or "name", "met", ...}], or a "targets_met" flag."""
    word = lambda v: str(v.get("verdict") or ("met" if v["met"] else "missed"))  # noqa: E731
    targets = report.get("targets")
    out: dict[str, str] = {}
    if isinstance(targets, dict):
        for name, v in targets.items():
            if isinstance(v, bool):
                out[name] = "met" if v else "missed"
            elif isinstance(v, dict) and "met" in v:
                out[str(v.get("target") or v.get("name") or name)] = word(v)
    elif isinstance(targets, list):
        for i, v in enumerate(targets):
            if isinstance(v, dict) and "met" in v:
                out[str(v.get("target") or v.get("name") or f"target {i}")] = word(v)
    if isinstance(report.get("targets_met"), bool):
        out["targets_met"] = "met" if report["targets_met"] else "missed"
    return out


def headline_of(name: str, report: dict[str, Any]) -> dict[str, Any]:
    """A benchmark's headline figures: its own "headline", else its `HEADLINE_KEYS` (dicts flattened one level)."""
    if isinstance(report.get("headline"), dict):
        return dict(report["headline"])
    out: dict[str, Any] = {}
    for key in HEADLINE_KEYS.get(name, []):
        value = report.get(key)
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in value.items() if not isinstance(v, (dict, list))})
        elif value is not None and not isinstance(value, list):
            out[key] = value
    return out


def run_one(name: str, command: list[str], report_path: Path, log_path: Path, timeout_s: float) -> BenchOutcome:
    """Run one benchmark's command (output to `log_path`) and read the report it wrote; never raises for
    the benchmark's own failure."""
    report_path.unlink(missing_ok=True)  # a report left from an earlier run must not pass for this one
    started = time.perf_counter()
    rc: int | None = None
    with log_path.open("w") as out:
        # its own process group: on a timeout (or Ctrl-C here) the workers and servers it started go with it
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        finally:
            stop_group(proc)
    seconds = time.perf_counter() - started
    outcome = BenchOutcome(name, "ok", seconds, command, str(report_path), str(log_path))
    report: dict[str, Any] | None = None
    if report_path.exists():
        try:
            report = json.loads(report_path.read_text())
        except (OSError, ValueError):
            report = None
    if rc is None:
        outcome.status = f"timed out after {timeout_s:g} s"
    elif rc != 0:
        outcome.status = f"failed (exit {rc})"
    elif report is None:
        outcome.status = "no report"
    if report is not None and outcome.status == "ok" and report.get("skipped"):
        outcome.status = "ok; skipped " + ", ".join(f"{part} ({why})" for part, why in report["skipped"].items())
    if report is not None:
        prov = report.get("provenance") or {}
        outcome.commit, outcome.dirty = prov.get("commit") or report.get("commit"), prov.get("dirty")
        outcome.headline, outcome.targets = headline_of(name, report), targets_of(report)
    return outcome


def _figure(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.3g}"
    return str(value)


def summary_markdown(outcomes: list[BenchOutcome]) -> str:
    """The summary as a markdown table: benchmark, status, seconds, commit, headline figures, targets, and the
    CPUs busy in the second before it started."""
    lines = ["| benchmark | status | seconds | commit | headline | targets | CPUs busy before |",
             "|---|---|---|---|---|---|---|"]
    for o in outcomes:
        figures = list(o.headline.items())
        shown = ", ".join(f"{k} {_figure(v)}" for k, v in figures[:MAX_FIGURES])
        if len(figures) > MAX_FIGURES:
            shown += f", … ({len(figures) - MAX_FIGURES} more in the JSON)"
        met = sum(v == "met" for v in o.targets.values())
        verdicts = (f"{met}/{len(o.targets)} met" + "".join(f"; {v.upper()} {k}" for k, v in o.targets.items()
                                                             if v != "met") if o.targets else "")
        commit = f"{o.commit[:10]}{'+dirty' if o.dirty else ''}" if o.commit else ""
        busy = "" if o.busy_cpus_before is None else f"{o.busy_cpus_before:.2f}"
        lines.append(f"| {o.name} | {o.status} | {o.seconds:.0f} | {commit} | {shown} | {verdicts} | {busy} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- command

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--only", default=None, help="comma-separated benchmarks to run (default: all)")
    p.add_argument("--skip", default=None, help="comma-separated benchmarks to leave out")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds one benchmark may run (default 3600)")


def run(args: argparse.Namespace) -> int:
    from ops.bench import BENCHES
    from ops.bench.report import provenance, write_report

    try:
        names = selected(run_order([n for n in BENCHES if n not in ("all", *PART_OF)]), args.only, args.skip)
    except ValueError as exc:
        raise SystemExit(f"edgeserve bench all: {exc}") from exc
    summary_path = Path(args.json_path)
    folder = summary_path.with_suffix("")  # bench-results/all.json -> bench-results/all/
    folder.mkdir(parents=True, exist_ok=True)
    started_at = provenance()
    outcomes: list[BenchOutcome] = []
    for i, name in enumerate(names):
        bench, extra = VARIANTS.get(name, (name, []))
        print(f"[{i + 1}/{len(names)}] edgeserve bench {' '.join([bench, '--quick', *extra])}", file=sys.stderr,
              flush=True)
        report = folder / f"{name}.json"
        command = [sys.executable, "-m", "ops.cli", "bench", bench, "--quick", "--json", str(report), *extra]
        busy, waited = wait_idle(IDLE_BUSY_CPUS, max_wait_s=IDLE_WAIT_S)
        if busy >= IDLE_BUSY_CPUS:
            print(f"    warning: {busy:.2f} CPUs still busy after {waited:.0f} s; starting anyway", file=sys.stderr,
                  flush=True)
        elif waited > 1.5:
            print(f"    waited {waited:.0f} s for the machine to be idle", file=sys.stderr, flush=True)
        outcome = run_one(name, command, report, folder / f"{name}.log", args.timeout)
        outcome.busy_cpus_before = busy
        outcomes.append(outcome)
        print(f"    {outcome.status} in {outcome.seconds:.0f} s", file=sys.stderr, flush=True)
    markdown = summary_markdown(outcomes)
    print("\n" + markdown)
    md_path = summary_path.with_suffix(".md")
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text(f"# `edgeserve bench all` (quick runs), commit {started_at['commit']}"
                       f"{' (dirty tree)' if started_at['dirty'] else ''}\n\n" + markdown)
    print(f"wrote {md_path}")
    write_report(str(summary_path), {
        "benchmarks": [asdict(o) for o in outcomes],
        "failed": [o.name for o in outcomes if not o.status.startswith("ok")],
        "targets_not_met": {o.name: {k: v for k, v in o.targets.items() if v != "met"} for o in outcomes
                            if any(v != "met" for v in o.targets.values())},
        "total_s": sum(o.seconds for o in outcomes),
    })
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m ops.bench.all` (what `make bench` runs): the same options as `edgeserve bench all`."""
    p = argparse.ArgumentParser(prog="edgeserve bench all", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true", help="accepted for symmetry: every run is a quick run")
    p.add_argument("--json", dest="json_path", default="bench-results/all.json", help="where to write the summary")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
