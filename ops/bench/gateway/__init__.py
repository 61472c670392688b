"""Gateway overhead: the edgeserve gateway and LiteLLM's proxy in front of the same instant worker.

Processes, all on this machine: Redis (`ops.redis_server`), a stand-in worker (no
model; `standin_per_token`, a subprocess) that streams exactly as real
workers do: one NDJSON `TokenEvent` per token on the worker protocol, one SSE chunk
per token on its OpenAI endpoint, with no pause between tokens, so every per-token
cost of a path shows in its latency. Then the edgeserve gateway (`edgeserve
gateway`, a subprocess, as deployed) and LiteLLM's proxy (a subprocess from its
own venv under ~/.cache/edgeserve/bench-venvs/litellm, installed on first use;
skipped with ``--no-litellm`` or when it does not install). Targets, all OpenAI
``POST /v1/chat/completions`` for the same N tokens:

- ``direct``: the stand-in itself (the floor: load generator + HTTP + stand-in);
- ``worker``: the stand-in's worker protocol (``/v1/generate``, the gateway's request
  to it for a non-streamed chat: the chat template's prompt ids, N tokens, ``stream:
  false``, so the worker holds its NDJSON lines and writes them together), read whole;
  non-stream settings only. Not a target for the added latency: it shows what the
  worker leg costs by itself, which the gateway path pays and ``direct`` does not
  (until 2026-12-06 it asked for a stream, one line per token, which the gateway's
  non-streamed requests no longer do: ~0.6 ms more here);
- ``passthrough``: the framework floor (`passthrough`): a bare proxy on the gateway's stack (Starlette,
  uvicorn with uvloop and httptools, aiohttp to the stand-in), relaying the chat request and its answer
  and doing nothing else. Its added latency is what a Python ASGI proxy on these libraries pays here;
  the edgeserve targets' p50 above its p50 (``over_floor``, printed under the table, round by round too)
  is the gateway's own work, which a slow spell of this VM inflates less than the added latency;
- ``edgeserve``: the gateway with a tenant without quotas: each request still
  authenticates, is tokenised, routed, detokenised and metered in Redis;
- ``edgeserve+quota``: the same gateway with a tenant that has both quotas
  (requests per minute and tokens per day, set far above what the run uses), so
  each request also passes quota admission and settles its reservation;
- ``litellm``: the proxy with model ``openai/smollm2-135m`` at the stand-in and
  a static ``master_key`` (no database: that is how LiteLLM runs without
  Postgres, and it leaves out its virtual keys, spend tracking and rate limits).
  Otherwise its defaults (one process, uvicorn; `LITELLM_LOCAL_MODEL_COST_MAP`
  is set only so start-up does not fetch the cost map from the network);
- with ``--baseline REF``: ``edgeserve@REF`` and ``edgeserve+quota@REF``, a second
  gateway run from ``git archive REF`` (same Redis, stand-in and requests), so a
  change is measured against the code before it in the same run.

Load: closed loop in this process: c users, each with its own httpx.AsyncClient
(one keep-alive connection), send requests back to back for a round of D seconds
(after a short unmeasured warm-up round that reopens connections). Rounds are
interleaved: every repetition visits every setting (c x stream) and within it
every target, the order rotating, so a burst of machine noise lands on all
targets rather than one. Latency: non-stream, the full response; stream, the last
byte (TTFT: the first body bytes). Percentiles are nearest-rank over all rounds'
requests; requests/s = requests / seconds of all rounds. Added latency = target
p50 (p95, p99) minus direct's at the same setting; both pay the load generator
and the stand-in, so the difference is what the proxy adds (its work and one more
loopback hop). The load generator's own garbage collector runs only between
rounds. CPU ms/request: CPU time of the proxy process (and of Redis, for
edgeserve) over its measured rounds / requests.

This machine has few cores (often 2): the load generator, the stand-in, the proxy
and Redis share them. Each proxy is one process (one core at most), so once c is
high enough to keep it busy its requests/s is about 1 / its CPU per request, and
CPU ms/request is the steadier measure of a proxy's cost than latency.

JSON: ``added_latency_ms`` maps target -> setting ("c1_nostream", "c1_stream", ...)
-> {"p50", "p95", "p99"}; ``headline`` holds edgeserve+quota's added p50 at c=1, both ways
(the 2 ms target), the pass-through's, and edgeserve+quota's p50 above the pass-through's;
``rps`` maps target -> setting -> requests/s (litellm null when unavailable); ``over_floor``
maps setting -> the pass-through's added p50 and each edgeserve target's p50 above it
(`report.over_floor`); ``added_latency_p50_ms`` / ``_p99_ms`` keep the older keys for the
tenant without quotas; ``targets`` gives each target a verdict judged
round by round (`report.target_verdicts`: the added p50 with quotas at c = 1 within 2 ms, both
ways; more requests/s than LiteLLM at every setting, where it ran). With ``--baseline``, ``baseline.vs_baseline``
also pairs the two gateways round by round (``p50_round_ratio``, ``cpu_round_ratio``:
median, min, max of this tree / the baseline over the rounds; printed under the table),
which on a machine whose speed drifts is steadier than the pooled figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from dataclasses import asdict
from pathlib import Path

from ops.bench.gateway.load import MODEL, measure, setting_key
from ops.bench.gateway.report import (ADDED_P50_TARGET_MS, compare, over_floor, plot_rows, print_over_floor,
                                      print_table, print_vs_baseline, target_verdicts, vs_baseline)
from ops.bench.gateway.servers import LITELLM_VENV, check_all, ensure_litellm, has_modules, start_targets
from ops.bench.harness.progress import log
from ops.bench.report import write_report
from ops.cluster import machine_info

__all__ = ["add_arguments", "run", "TARGETS"]

# table order; a baseline's gateways follow their own
TARGETS = ("direct", "worker", "passthrough", "edgeserve", "edgeserve+quota", "litellm")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=32, help="tokens per response, N (default 32)")
    p.add_argument("--concurrency", default=None, help="comma-separated (default 1,16,64; quick 1,16)")
    p.add_argument("--rounds", type=int, default=None, help="repetitions of every setting (default 6; quick 2)")
    p.add_argument("--round-seconds", type=float, default=None, help="measured seconds per round (default 2; "
                                                                       "quick 0.75)")
    p.add_argument("--no-litellm", action="store_true", help="skip LiteLLM (no install, no proxy)")
    p.add_argument("--baseline", default=None, metavar="REF",
                   help="also measure the gateway of git commit REF (e.g. HEAD~1), in the same rounds")
    p.add_argument("--litellm-venv", default=str(LITELLM_VENV))


def run(args: argparse.Namespace) -> int:
    from ops.pull import resolve_model
    from ops.standin_worker import token_text

    quick = args.quick
    points = [int(c) for c in args.concurrency.split(",")] if args.concurrency else ([1, 16] if quick else [1, 16, 64])
    rounds = args.rounds or (2 if quick else 6)
    duration_s = args.round_seconds or (0.75 if quick else 2.0)
    warmup_s = min(0.25, duration_s / 3)
    started = time.perf_counter()
    machine = machine_info()

    resolve_model(MODEL)  # pulled once, with progress, before anything starts
    litellm_exe, litellm_version, litellm_note = (None, None, "skipped (--no-litellm)")
    if not args.no_litellm:
        litellm_exe, litellm_version, litellm_note = ensure_litellm(Path(args.litellm_venv))
        log(f"litellm: {litellm_version or litellm_note}")
    servers = {"edgeserve": has_modules(sys.executable, ["uvloop", "httptools"])}
    if litellm_exe is not None:
        servers["litellm"] = has_modules(str(Path(args.litellm_venv) / "bin" / "python"), ["uvloop", "httptools"])

    with contextlib.ExitStack() as stack:
        targets, litellm_note, baseline = start_targets(stack, args.tokens, litellm_exe, litellm_note,
                                                         args.baseline, log)
        content_checks = asyncio.run(check_all(targets, args.tokens, token_text(args.tokens)[1]))
        for name, problem in content_checks.items():
            if problem:
                log(f"warning: {name} does not return the stand-in's text: {problem}")
        log(f"measuring {', '.join(t.name for t in targets)}: c={points}, stream and not, {rounds} rounds of "
            f"{duration_s:g} s each (+{warmup_s:g} s warm-up), N={args.tokens} tokens")
        rows = asyncio.run(measure(targets, points, [False, True], args.tokens, rounds, duration_s, warmup_s, log))
    total_s = time.perf_counter() - started

    cmp = compare(rows)
    have_litellm = any(r.target == "litellm" for r in rows)
    print(f"\nedgeserve bench gateway  N={args.tokens} tokens/response, {rounds} rounds x {duration_s:g} s per "
          f"target and setting{' (quick)' if quick else ''}")
    print(f"machine: {machine['cpus_usable']} CPUs ({machine['cpu_model']}), shared by the load generator, the "
          f"stand-in worker, the proxy and Redis")
    print(f"litellm: {litellm_version if have_litellm else 'unavailable: ' + litellm_note}; "
          f"uvloop/httptools: " + ", ".join(f"{k} {v}" for k, v in servers.items()))
    print_table(rows, cmp)
    print("added = target - direct at the same setting; cpu ms/req = the proxy's CPU (+ Redis's for edgeserve) "
          f"per request; took {total_s:.0f} s")
    floor = over_floor(rows)
    print("the gateway's own work: p50 above the pass-through's at the same setting (ms; round by round [min, max])")
    print_over_floor(floor)
    verdicts = target_verdicts(rows)
    print("targets (round by round): " + ", ".join(
        f"{name} {t['verdict']} [{', '.join(format(v, '.2f') for v in t['per_round'])}]"
        for name, t in verdicts.items()))
    vs = None if baseline is None else vs_baseline(rows, cmp, baseline)
    if vs is not None:
        print_vs_baseline(vs, baseline)

    keys = [setting_key(c, s) for c in points for s in (False, True)]
    names = [t.name for t in targets]
    rps = {t: ({r.key: r.rps for r in rows if r.target == t} or None) for t in (*TARGETS, *names)}
    edge, quota = cmp.get("edgeserve", {}), cmp.get("edgeserve+quota", {})
    added = {t: {k: {q: v[f"added_{q}_ms"] for q in ("p50", "p95", "p99")} for k, v in per.items()}
             for t, per in cmp.items() if t != "direct"}
    report = {
        "quick": quick,
        "machine": machine,
        "config": {"tokens": args.tokens, "concurrency": points, "rounds": rounds, "round_seconds": duration_s,
                   "warmup_seconds": warmup_s, "settings": keys, "model": MODEL,
                   "latency": "non-stream: full response; stream: last byte; ttft: first body bytes"},
        "headline": {"target": "edgeserve+quota", "target_added_p50_ms": ADDED_P50_TARGET_MS,
                     **{f"added_p50_ms_{k}": added.get("edgeserve+quota", {}).get(k, {}).get("p50")
                        for k in ("c1_nostream", "c1_stream")},
                     **{f"passthrough_added_p50_ms_{k}": floor.get(k, {}).get("floor_added_p50_ms")
                        for k in ("c1_nostream", "c1_stream")},
                     **{f"above_passthrough_p50_ms_{k}": floor.get(k, {}).get("above_floor_p50_ms", {}).get(
                         "edgeserve+quota") for k in ("c1_nostream", "c1_stream")}},
        "added_latency_ms": added,
        "added_latency_p50_ms": {k: v["added_p50_ms"] for k, v in edge.items()},
        "added_latency_p99_ms": {k: v["added_p99_ms"] for k, v in edge.items()},
        "rps": rps,
        "rps_ratio_edgeserve_vs_litellm": {k: v["rps_ratio_vs_litellm"] for k, v in edge.items()}
        if have_litellm else None,
        "rps_ratio_edgeserve_quota_vs_litellm": {k: v["rps_ratio_vs_litellm"] for k, v in quota.items()}
        if have_litellm else None,
        "baseline": None if baseline is None else {"ref": args.baseline, "commit": baseline,
                                                   "vs_baseline": vs},
        "comparison": cmp,
        "over_floor": floor,
        "targets": verdicts,
        "litellm": {"available": have_litellm, "version": litellm_version, "note": litellm_note},
        "servers_have": servers,
        "content_checks": content_checks,
        "rows": [asdict(r) for r in rows],
        "total_s": total_s,
    }
    path = write_report(args.json_path, report)
    png = path.with_suffix(".png")
    if plot_rows(rows, cmp, f"gateway overhead, N={args.tokens} tokens, {machine['cpus_usable']} shared CPUs", png):
        print(f"wrote {png}")
    return 0
