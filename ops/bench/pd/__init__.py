"""Disaggregated prefill/decode vs unified, the prefix cache on vs off, and KV bytes on the wire.

Real workers (`edgeserve serve` subprocesses, SmolLM2-135M, float32 compute).
Each holds ~2.5 GB (weights and their MKL-packed copies), so at most three run
at once, by phase: mixed (unified, prefill, decode), wire (prefill, decode,
decode_bf16), shared prefix (unified, unified_cache). An idle worker only wakes
twice a second, so the ones not under test cost nothing measurable.

- ``unified``: ``--role unified --threads 2 --kv-format fp8_e4m3``;
- ``prefill`` + ``decode``: ``--role prefill --threads 1 --kv-format fp32`` and
  ``--role decode --threads 1 --kv-format fp8_e4m3 --kv-wire fp8_e4m3`` pointing at
  it (2 threads against 1 + 1: the same two cores, split);
- ``unified_cache``: the unified worker with ``--prefix-caching``;
- ``decode_bf16``: a second decode worker on the same prefill worker, ``--kv-wire bf16``.

Prompts are synthetic token ids from seeded RNGs, uniform in [100, 40000) (no
chat template; the model's text quality plays no part). Every request is greedy
with EOS ignored, so each produces exactly its max_tokens. Each worker is warmed
up (a short and a long request) before anything is measured.

1. Mixed (interference). S closed-loop clients (6) send short requests, 64 prompt
   + 64 output tokens, back to back, while long prompts (1024 + 8 tokens, one every
   10 s, the first 1 s into the window; quick: 512 tokens every 5 s) arrive open
   loop. A heavier stream, 1536 tokens every 5 s, cannot be sustained here: one thread
   prefills ~210 tokens/s, so the prefill worker would fall behind without end;
   1024 every 10 s keeps it about 60% busy, short prompts included. The clients
   start one by one over a ramp (6 s; quick 4 s, unmeasured) so their requests do
   not move in lockstep; then comes the measured window of D seconds. A short
   request lasts 10-20 s here, so few are *sent* inside a window; the decode gaps
   are therefore taken by time, not by request. After the window the load goes on
   until every request sent inside it has its first token; then the rest are
   cancelled (as a client that leaves) and each worker of the configuration must
   go idle with every page free (reported; waited for at most 10 s).
   Configurations alternate U D D U (full, 30 s windows) or U D (quick, 15 s), one
   at a time on the shared cores; figures pool the rounds of a configuration (per
   round values are in the JSON, to show the spread). All requests of the
   disaggregated configuration go to the decode worker.
   - TTFT: client clock, request sent -> first token event received, of the
     requests sent inside the window.
   - TPOT: the gap before every short-request token that reached the client inside
     the window (any request's), from the worker's own per-token times
     (`TokenEvent.times`, stamped when the step that made the token ended);
     p50/p95 are nearest-rank over all those gaps (vLLM's inter-token latency).
     The same gaps on the client's arrival clock are in the JSON (``tpot_client_*``).
   - output tok/s: tokens of any request that reached the client inside the window / D.
   Target: short-request TPOT p95 lower disaggregated than unified (no prompt
   chunk ever shares a decode step there). The expected cost: short prompts are
   prefilled by one thread and travel over HTTP, and a short prompt that lands
   on the prefill worker beside a long one shares its steps, so short TTFT rises.
2. Shared prefix. N requests (40; quick 8): a 1024-token system prompt shared by
   90% of them (the other 10%, chosen by the RNG, get their own random prefix),
   each + a unique 32-token suffix, 8 output tokens, closed loop at concurrency
   2, on ``unified_cache`` and on ``unified``. Hit rate: the change in the cache
   worker's `/stats` prefix_cache hit_tokens / query_tokens over the run (warm-up
   excluded); the clients' own sum of cached_tokens / prompt tokens is a cross-check.
   Target: TTFT p50 with the cache <= 0.3 x without.
3. Wire bytes. W identical requests (512 prompt tokens, 2 output; 4, quick 2) one
   at a time through each decode worker; bytes per token = the change in that
   decode worker's `/stats` kv_transfer bytes / tokens (payload + 64 bytes a
   frame, as it counts), with the prefill worker's own count of bytes sent
   alongside. Theory for SmolLM2 (head_dim 64): BF16 128 bytes per (token, KV
   head) against FP8's 64 values + 1 exponent byte, 128/65 = 1.97. Target: FP8
   at least halves the bytes, read as bf16 / fp8 >= 1.9.

Load average (`os.getloadavg`) is recorded at the start, after each phase and at
the end: other processes on this machine share its cores, and so does this load
generator. Worker logs are scanned for warnings and errors at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

from backend.heap import freeze_heap
from ops.bench.harness.machine import load_average, mem_available_gib, uptime
from ops.bench.harness.procs import log_lines
from ops.bench.harness.progress import log
from ops.bench.pd.phases import MixedSettings, mixed_phase, prefix_phase, wire_phase
from ops.bench.pd.report import build_report, plot_result, print_tables
from ops.bench.pd.transport import TRANSPORT_WORKERS, transport_phase
from ops.bench.pd.workers import Workers
from ops.bench.report import write_report
from ops.cluster import machine_info

__all__ = ["add_arguments", "run", "PHASES", "scan_logs"]

PHASES = ("mixed", "wire", "prefix", "transport", "store")


def scan_logs(logs: Path) -> dict[str, dict[str, Any]]:
    """Per worker log: how many warning / error / traceback lines, and the first few."""
    found = log_lines(logs, lambda line: '"level":"WARNING"' in line or '"level":"ERROR"' in line
                      or "Traceback" in line)
    return {name: {"count": len(bad), "first": [line[:300] for line in bad[:5]]} for name, bad in found.items()}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--duration", type=float, default=None, help="mixed: seconds per round (default 30; quick 15)")
    p.add_argument("--pairs", type=int, default=None, help="mixed: round pairs, U D D U ... (default 2; quick 1)")
    p.add_argument("--short-clients", type=int, default=6)
    p.add_argument("--long-prompt", type=int, default=None, help="mixed: long prompt tokens (default 1024; quick 512)")
    p.add_argument("--long-interval", type=float, default=None, help="mixed: seconds between long prompts "
                                                                      "(default 10; quick 5)")
    p.add_argument("--prefix-requests", type=int, default=None, help="shared prefix: N (default 40; quick 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-transport", default="http", choices=["http", "mooncake"],
                   help="the mixed phase's decode worker's KV transport (the transport phase runs both)")
    p.add_argument("--phases", default=",".join(PHASES),
                   help=f"comma-separated subset of {','.join(PHASES)} (default: all)")
    p.add_argument("--transport-requests", type=int, default=None,
                   help="transport: requests per prompt length and transport (default 6, quick too: the target is "
                        "judged on the pairs' interval)")


def run(args: argparse.Namespace) -> int:
    from ops.pull import resolve_model

    quick = args.quick
    mixed = MixedSettings(duration_s=args.duration or (15.0 if quick else 30.0), short_clients=args.short_clients,
                          short_prompt=64, short_output=64, long_prompt=args.long_prompt or (512 if quick else 1024),
                          long_output=8, long_interval_s=args.long_interval or (5.0 if quick else 10.0),
                          ramp_s=4.0 if quick else 6.0)
    pairs = args.pairs or (1 if quick else 2)
    prefix = {"requests": args.prefix_requests or (8 if quick else 40), "prefix_tokens": 1024, "suffix_tokens": 32,
              "shared": 0.9, "output_tokens": 8, "concurrency": 2}
    wire = {"requests": 2 if quick else 4, "prompt_tokens": 512, "output_tokens": 2}
    started = time.perf_counter()
    machine = {**machine_info(), "uptime_start": uptime()}
    loads: dict[str, dict[str, Any]] = {}

    def mark(phase: str) -> None:
        loads[phase] = {"at_s": round(time.perf_counter() - started, 1), "load_1_5_15": load_average(2),
                        "mem_available_gb": mem_available_gib(1)}
        log(f"[{loads[phase]['at_s']:.0f} s] {phase}: load average {loads[phase]['load_1_5_15']}, "
            f"{loads[phase]['mem_available_gb']} GB memory available")

    mark("start")
    resolve_model(args.model)  # pulled once, with progress, before any worker starts
    logs = Path(tempfile.mkdtemp(prefix="edgeserve-bench-pd-"))
    freeze_heap()  # this process holds torch: a full collection would land in some request's latency

    phases = [x for x in args.phases.split(",") if x]
    unknown = set(phases) - set(PHASES)
    if unknown:
        raise SystemExit(f"bench pd: unknown phases {sorted(unknown)}; choose from {','.join(PHASES)}")
    transport = {"lengths": (256, 1024), "requests": args.transport_requests or 6}
    result: dict[str, Any] = {}
    with Workers(args.model, logs, log, args.kv_transport) as workers:
        urls = workers.urls
        if "mixed" in phases:
            workers.start("unified", "prefill", "decode")
            mark("mixed_workers_up")
            result.update(asyncio.run(mixed_phase(urls, mixed, pairs, mark, log)))
            mark("after_mixed")
            workers.stop("unified", "prefill", "decode")
        if "wire" in phases:
            workers.start("prefill", "decode", "decode_bf16")
            result["wire"] = asyncio.run(wire_phase(urls, wire, args.seed, log))
            mark("after_wire")
            workers.stop("prefill", "decode", "decode_bf16")
        if "prefix" in phases:
            workers.start("unified", "unified_cache")
            mark("prefix_workers_up")
            result["prefix"] = asyncio.run(prefix_phase(urls, prefix, args.seed, log))
            workers.stop("unified", "unified_cache")
        if "transport" in phases:
            workers.start(*TRANSPORT_WORKERS)
            mark("transport_workers_up")
            result["transport"] = asyncio.run(transport_phase(urls, workers.pids, transport["lengths"],
                                                              transport["requests"], args.seed, log))
            mark("after_transport")
            workers.stop(*TRANSPORT_WORKERS)
    if "store" in phases:
        from ops.bench.pd.store import store_ttft
        from ops.cluster import mooncake_master

        store = {"prompt_tokens": 1024, "repeats": 2 if quick else 5, "kv_format": "fp8_e4m3"}
        with mooncake_master(logs / "mooncake_master.log") as master:
            got = store_ttft(resolve_model(args.model), master, store["prompt_tokens"], store["repeats"],
                             kv_format=store["kv_format"], seed=args.seed)
        result["store"] = store | got._asdict()
        log(f"store: hit TTFT p50 {got.store_hit_p50_s:.3f} s, miss {got.store_miss_p50_s:.3f} s")
        mark("after_store")
    result["final_stats"] = workers.final_stats
    mark("end")
    machine["uptime_end"] = uptime()
    problems = scan_logs(logs)
    total_s = time.perf_counter() - started

    report = build_report(args, quick, machine, loads, mixed, pairs, prefix, wire | {}, result, problems, total_s)
    report["settings"]["transport"] = transport
    print_tables(report)
    path = write_report(args.json_path, report)
    png = path.with_suffix(".png")
    if plot_result(result, png):
        print(f"wrote {png}")
    if any(p["count"] for p in problems.values()):
        print(f"worker logs kept in {logs}")
    else:
        for f in logs.glob("*.log"):
            f.unlink()
        logs.rmdir()
    return 0
