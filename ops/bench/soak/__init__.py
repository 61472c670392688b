"""Soak: a local cluster under mixed tenant traffic while workers, a prefill transfer and Redis are killed.

    edgeserve bench soak [--quick] [--minutes N] [--json PATH]

The cluster, all on this machine, every process with one ``EDGESERVE_WORKER_TOKEN``:
Redis (persistent: append-only file, fsync on every write, so a restart keeps
tenants and usage), a unified worker, a prefill worker and a decode worker paired
with it (SmolLM2-135M, ``--threads 1 --gemm-buckets none --kv-cache-bytes 64M``,
prefix caching on the unified and prefill workers), and two gateways routing over
the Redis registry.

Traffic (`ops.bench.soak.traffic`), spread over both gateways and both APIs, half
streamed, 8-24 output tokens: two clients of an unlimited tenant, one of a tenant
whose clients sometimes leave non-streamed requests before their answer, one of a
tenant limited to a few requests a minute and one limited in tokens a day (both
get 429s); streamed requests are left after 1-3 content events 15% of the time.
Alongside, a malformed request every second or so, of every kind in turn (bad
JSON, wrong types, 1000-deep nesting, no or unknown key, unknown model, another
tenant's account, a 64 KB header, a body cut off mid-read).

Faults, on a schedule spread over the run (each at its time, recovered or not the one before):

- ``worker_kill``: SIGKILL the unified worker, restart it at once on the same port;
  recovered when a request straight to it succeeds;
- ``prefill_kill_mid_transfer``: send a 480-token prompt to the decode worker, and
  SIGKILL the prefill worker while the transfer is open (its `/stats` shows the prompt
  held for shipping, or failing that still computing); restart it; recovered when a
  request through the decode worker succeeds. The victim's last event is recorded;
- ``redis_restart``: SIGKILL redis-server, leave it down a few seconds, start it again
  on the same port and files; recovered when a request succeeds through every gateway.

Then the load stops, every request runs to its end, and the harness waits for every
worker to be idle and the tenants' usage counters to stop moving, and checks
(`ops.bench.soak.checks`, which defines every count): no 5xx but typed 503s during faults,
metered == sent per tenant, metered completion tokens >= delivered, no leaked page,
no worker busy, no request past its timeout, every fault recovered. The exit status
is 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ops.bench.harness.procs import log_lines
from ops.bench.harness.progress import log
from ops.bench.report import provenance, write_report
from ops.bench.soak.checks import build_report, missing_ids
from ops.bench.soak.cluster import WORKER_FLAGS, Cluster, create_tenants
from ops.bench.soak.scenario import Settings, Soak, fault_schedule
from ops.bench.soak.settle import diagnose_missing, wait_idle, wait_settled
from ops.bench.soak.traffic import MODEL, TENANTS
from ops.cluster import machine_info

__all__ = ["add_arguments", "run", "scan_logs"]


def scan_logs(logs: Path) -> dict[str, int]:
    """Per process log: lines that report a traceback or an ERROR (findings, not targets)."""
    return {name: len(lines) for name, lines in log_lines(logs, lambda line: "Traceback" in line
                                                          or "ERROR" in line).items()}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=None, help="minutes of load (default 10; quick 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep-logs", action="store_true", help="keep the processes' logs even when every target is met")


def run(args: argparse.Namespace) -> int:
    from gateway.redis_keys import utc_day
    from ops.pull import resolve_model

    settings = Settings(duration_s=60 * (args.minutes or (1.0 if args.quick else 10.0)), seed=args.seed,
                        redis_outage_s=4.0 if args.quick else 10.0)
    started = time.perf_counter()
    resolve_model(MODEL)  # pulled once, before any process starts
    logs = Path(tempfile.mkdtemp(prefix="edgeserve-soak-"))
    cluster = Cluster(logs, secrets.token_urlsafe(24))
    first_day = utc_day()
    try:
        cluster.start(log)
        tenants = asyncio.run(create_tenants(cluster.redis_url))
        log(f"soak: {settings.duration_s:.0f} s of load, faults at "
            + ", ".join(f"{at:.0f} s {kind}" for at, kind in fault_schedule(settings.duration_s)))
        soak = Soak(cluster, tenants, settings, log)
        asyncio.run(soak.run())
        run_end_s = soak.now()
        final_stats = asyncio.run(wait_idle(cluster, 30.0))
        days = sorted({first_day, utc_day()})
        metered = wait_settled(cluster.redis_url, tenants, days, settings.settle_cap_s)
        alive = [svc.name for svc in cluster.services if not svc.alive]
        diagnosis = diagnose_missing(cluster.redis_url, tenants, missing_ids(soak.results, metered))
    finally:
        cluster.stop()
    report = build_report(soak.results, soak.faults, metered, final_stats, grace_s=settings.grace_s,
                          run_end_s=run_end_s, request_timeout_s=settings.request_timeout_s)
    report = {**provenance(), "quick": args.quick, "machine": machine_info(), "settings": asdict(settings),
              "model": MODEL, "worker_flags": WORKER_FLAGS, "tenants": {n: {"requests_per_minute": v[0],
              "tokens_per_day": v[1], "clients": v[2]} for n, v in TENANTS.items()},
              **report, "missing_diagnosis": diagnosis, "processes_dead_at_end": alive,
              "log_error_lines": scan_logs(logs),
              "final_worker_stats": final_stats, "total_s": round(time.perf_counter() - started, 1)}
    _print(report)
    write_report(args.json_path, report)
    missed = [t["name"] for t in report["targets"] if not t["met"]]
    if missed or args.keep_logs:
        print(f"process logs kept in {logs}")
    else:
        import shutil

        shutil.rmtree(logs, ignore_errors=True)
    return 1 if missed else 0


def _print(r: dict[str, Any]) -> None:
    m = r["machine"]
    print(f"\nedgeserve bench soak{' (quick)' if r['quick'] else ''}: {r['requests']} requests in "
          f"{r['settings']['duration_s']:.0f} s of load, {m['cpus_usable']} CPUs ({m['cpu_model']}); "
          f"commit {(r['commit'] or '?')[:10]}{' (dirty)' if r['dirty'] else ''}; took {r['total_s']:.0f} s")
    print("outcomes: " + ", ".join(f"{k} {v}" for k, v in r["status_counts"].items())
          + "   HTTP: " + ", ".join(f"{k} {v}" for k, v in r["http_status_counts"].items()))
    print(f"\n{'tenant':<15}{'sent':>6}{'abandoned':>10}{'metered':>9}{'missing':>9}{'tok delivered':>14}"
          f"{'tok metered':>12}  ok")
    for name, t in r["metered_vs_sent"].items():
        print(f"{name:<15}{t['sent']:>6}{t['abandoned']:>10}{t['metered']:>9}{t['missing_ids']:>9}"
              f"{t['delivered_tokens']:>14}{t['metered_completion_tokens']:>12}  "
              f"{'yes' if t['ok'] and t['tokens_ok'] else 'NO'}")
    print(f"\n{'fault':<28}{'at s':>7}{'recovery s':>12}  detail")
    for f in r["faults_injected"]:
        rec = "-" if f["recovery_s"] is None else f"{f['recovery_s']:.1f}"
        print(f"{f['kind']:<28}{f['at_s']:>7.0f}{rec:>12}  {str(f['detail'])[:110]}")
    print(f"\nuntyped 5xx {r['untyped_5xx']}, typed 503 outside faults {r['unexpected_503']}, timed out "
          f"{r['timed_out']}, leaked pages {r['leaked_pages']} {r['leaked_pages_by_worker']}, max recovery "
          f"{r['max_recovery_s']} s")
    for ex in r["untyped_5xx_examples"][:5]:
        print(f"  untyped: {ex}")
    for t in r["targets"]:
        print(f"{'MET   ' if t['met'] else 'MISSED'} {t['name']}: {t['value']}")
