"""Routing policies compared: prefix-aware vs round-robin vs least-loaded, on 4 real workers.

Processes, all on this machine: Redis (`ops.redis_server`), four unified workers
(`edgeserve serve --model smollm2-135m --threads 1 --prefix-caching --redis-url R
--worker-id wN --kv-cache-bytes 256M`, subprocesses that heartbeat into the
registry and publish their prefix-cache KV events) and one gateway
(`edgeserve gateway --policy P`, no ``--worker``: it routes over the registry).
Cold caches: the workers and the gateway are restarted for every policy run (same
worker ids, same Redis, same tenants), so each run starts with empty prefix
caches, an empty prefix index and a gateway with nothing in flight. Each worker
is warmed up (one short request) before anything is measured.

Rounds: every policy runs once per round (``--rounds``, default one per policy),
the order rotated each round (`round_order`, a Latin rotation: round r starts at
the r-th policy), so over the rounds each policy runs first, in the middle and last
once: a slow spell of this shared machine, or whatever the previous run left
behind (page cache, memory), does not always fall on the same policy.

Workload (`make_workload`, seeded; identical for every policy): T tenants (8; quick 16),
each with its own API key and its own system prompt: a support-assistant
preamble and ~300 words (~400 tokens) of one Brown-corpus document (a different
document, so a different genre, per tenant). Each tenant has C conversations
(3; quick 1) of K turns (4; quick 3); turn k sends the whole conversation so far
(system, the previous user questions and assistant answers, a new question) to
``POST /v1/chat/completions``, streaming, ``max_tokens`` 16, temperature 0,
``stream_options.include_usage``. The assistant messages sent back are scripted
(a sentence of the tenant's document), not the model's reply: the workload then
does not depend on what the model says, and a worker caches only prompt blocks,
so what was generated never matters for the cache. Conversations start in a
seeded shuffled order, closed loop: U users (8) take turns from one queue of
ready turns, oldest first, and a conversation's next turn joins the back of that
queue when its previous turn has finished (``--turn-order interleaved``, the
default: with more conversations than users (16 or 24 for 8 users), a
conversation's next turn waits behind other conversations' turns, as a chat user's
next message follows a pause in which others' requests arrive).
``--turn-order back-to-back``: each user takes the next conversation and plays its
turns without a pause; `least-loaded` then keeps a conversation on one worker by
timing alone (the worker that has just answered is the least loaded one when the
next turn arrives), and with one conversation per tenant and as many
conversations as users (the quick run's workload before) it often reached the
prefix policy's hit rate.

Measured per policy, pooled over its rounds (all requests of all its runs; each
round's own figures and the targets' verdicts per round are in the JSON):
- hit rate: sum of ``usage.prompt_tokens_details.cached_tokens`` / sum of
  ``usage.prompt_tokens`` (token-weighted, not a mean of ratios); cross-checked
  against the change in the workers' own ``/stats`` prefix_cache counters
  (hit_tokens / query_tokens, summed over workers);
- TTFT p50/p95 (client clock: request sent -> first chunk with content;
  nearest-rank, `ops.bench.harness.stats.percentile`);
- throughput: requests/s and output tokens/s over the run's wall time;
- load per worker: requests (from the ``x-edgeserve-worker`` header, a tag of the worker id) and prompt
  tokens computed (prompt - cached); `max_over_mean` = the busiest worker's
  share over the mean of all four (an idle worker counts as 0);
- diagnostics: the share of later turns sent to the worker of the previous turn
  (`same_worker_rate`), and for the prefix policy the share of routes whose
  "N cached blocks" (``x-edgeserve-route``) equals what the worker then served
  from cache (`overlap_agreement`: is the prefix index in step with the caches?).
Targets (prefix policy): hit rate >= 2x round-robin's; TTFT p50 below both
baselines; no worker above 1.5x the mean request load. For scale, the hit-rate
ceiling (`ceiling_hit_rate`: one infinite cache shared by all workers, requests
in workload order) is printed too: round-robin also hits once a tenant's system
prompt has reached a worker, so 2x round-robin can lie above what any router
could reach.

This machine has few cores (often 2) and other people's processes run on it:
four single-threaded workers, the gateway, Redis and this load generator share
them, so the workers are CPU-starved and absolute numbers are low. The
comparison is what matters; the load average is recorded before and after each
policy. Each worker holds about 3 GiB resident, so four need ~13 GiB free: the run
refuses to start them with less (`--allow-low-memory` overrides). Worker and gateway
logs are scanned for warnings and errors.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from gateway.router import LOAD_SLACK, LOAD_SLACK_SHARE, RECOMPUTE_WEIGHT
from ops.bench.harness.machine import mem_available_gib
from ops.bench.harness.procs import log_lines
from ops.bench.harness.progress import log
from ops.bench.harness.stats import spread
from ops.bench.harness.tenants import create_tenants
from ops.bench.report import write_report
from ops.bench.routing.fleet import NUM_WORKERS, check_memory, start_fleet, warm_up, worker_hits, worker_stats
from ops.bench.routing.load import TURN_ORDERS, drive
from ops.bench.routing.measures import (PolicySummary, TurnResult, ceiling_hit_rate, check_targets, round_order,
                                        summarize, targets_by_round)
from ops.bench.routing.report import plot_summaries, print_table
from ops.bench.routing.workload import MODEL, brown_documents, make_workload, turn_keys, workload_prompt_ids
from ops.cluster import machine_info

__all__ = ["add_arguments", "run", "POLICIES"]

POLICIES = ("prefix", "round-robin", "least-loaded")


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _scan_logs(logs: Path) -> dict[str, list[str]]:
    """Warning, error and traceback lines of every log (at most 10 per log)."""
    found = log_lines(logs, lambda line: bool(re.search(r"WARNING|ERROR|Traceback|Exception", line)))
    return {name: lines[:10] for name, lines in found.items() if lines}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated; round r starts at the r-th")
    p.add_argument("--rounds", type=int, default=None, help="rounds of every policy, the order rotated each round "
                   "(default: one per policy, a full Latin rotation)")
    p.add_argument("--tenants", type=int, default=None, help="(default 8; quick 16)")
    p.add_argument("--conversations", type=int, default=None, help="per tenant (default 3; quick 1)")
    p.add_argument("--turns", type=int, default=None, help="per conversation (default 4; quick 3)")
    p.add_argument("--users", type=int, default=8, help="closed-loop concurrency (default 8)")
    p.add_argument("--turn-order", choices=TURN_ORDERS, default=TURN_ORDERS[0],
                   help="interleaved (default): a free user takes the oldest ready turn of any conversation; "
                        "back-to-back: each user plays one conversation's turns without a pause")
    p.add_argument("--load-slack", type=int, default=LOAD_SLACK,
                   help=f"the gateway's --load-slack for the prefix policy (default {LOAD_SLACK})")
    p.add_argument("--load-slack-share", type=float, default=LOAD_SLACK_SHARE,
                   help=f"the gateway's --load-slack-share (default {LOAD_SLACK_SHARE})")
    p.add_argument("--recompute-weight", type=float, default=RECOMPUTE_WEIGHT,
                   help=f"the gateway's --recompute-weight (default {RECOMPUTE_WEIGHT:g})")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--system-words", type=int, default=300, help="corpus words per system prompt (~1.3 tokens each)")
    p.add_argument("--kv-cache-bytes", default="256M", help="each worker's KV pool (default 256M)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logs", default=None, help="keep worker and gateway logs here (default: a temporary folder)")
    p.add_argument("--allow-low-memory", action="store_true",
                   help="start the workers even with less memory available than they need (default: refuse)")


def run(args: argparse.Namespace) -> int:
    from ops.pull import resolve_model
    from ops.redis_server import run_redis_server

    quick = args.quick
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise SystemExit(f"unknown policies {unknown}; choose from {POLICIES}")
    tenants = args.tenants or (16 if quick else 8)
    conversations = args.conversations or (1 if quick else 3)
    turns = args.turns or (3 if quick else 4)
    started = time.perf_counter()
    machine = {**machine_info(), "load_avg_start": list(os.getloadavg()),
               "mem_available_gib_start": mem_available_gib()}
    check_memory(args.allow_low_memory, log)

    resolve_model(MODEL)
    workload = make_workload(brown_documents(tenants, args.system_words), tenants, conversations, turns,
                             args.seed, args.system_words)
    prompts = workload_prompt_ids(workload)
    ceiling = ceiling_hit_rate(prompts)
    first_turn_tokens = _mean([len(ids) for (_, ids), (_, k) in zip(prompts, turn_keys(workload)) if k == 0])
    log(f"workload: {tenants} tenants x {conversations} conversations x {turns} turns = "
        f"{len(workload) * turns} requests per policy, {args.users} users ({args.turn_order}), max_tokens "
        f"{args.max_tokens}; first turns "
        f"{first_turn_tokens:.0f} prompt tokens on average, all turns {_mean([len(i) for _, i in prompts]):.0f}; "
        f"hit-rate ceiling {ceiling:.1%}")
    order = round_order(policies, args.rounds or len(policies))
    rounds: list[dict[str, PolicySummary]] = [{} for _ in order]  # per round: policy -> its figures
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}  # per policy: one entry per round
    results: dict[str, list[TurnResult]] = {p: [] for p in policies}
    with contextlib.ExitStack() as outer:
        if args.logs:
            logs = Path(args.logs)
            logs.mkdir(parents=True, exist_ok=True)
        else:
            logs = Path(outer.enter_context(tempfile.TemporaryDirectory(prefix="edgeserve-bench-routing-")))
        redis_url = outer.enter_context(run_redis_server())
        tokens = [t.token for t in asyncio.run(create_tenants(
            redis_url, [(f"bench-routing-{i + 1}", {}) for i in range(tenants)]))]
        for n, these in enumerate(order):
            for policy in these:
                log(f"round {n}, policy {policy}: starting 4 workers and the gateway (cold caches)")
                check_memory(args.allow_low_memory, log)
                with contextlib.ExitStack() as stack:
                    fleet = start_fleet(stack, redis_url, policy, args.kv_cache_bytes, logs, log, f"r{n}-",
                                        ("--load-slack", str(args.load_slack),
                                         "--load-slack-share", str(args.load_slack_share),
                                         "--recompute-weight", str(args.recompute_weight)))
                    workers = fleet.workers
                    asyncio.run(warm_up(list(workers)))
                    load_before = list(os.getloadavg())
                    before = asyncio.run(worker_stats(list(workers)))
                    got, wall_s, sample = asyncio.run(drive(f"{fleet.gateway_url}/v1/chat/completions", tokens,
                                                            workload, args.users, args.max_tokens, workers, log,
                                                            args.turn_order))
                    fleet.check_alive()
                    after = asyncio.run(worker_stats(list(workers)))
                for r in got:
                    r.round = n
                results[policy] += got
                s = rounds[n][policy] = summarize(policy, got, sorted(workers.values()), wall_s)
                hits = worker_hits(before, after)
                runs[policy].append({"round": n, "position": these.index(policy), "summary": s._asdict(),
                                     "hit_rate_workers": hits[0] / hits[1] if hits[1] else 0.0, "worker_hits": hits,
                                     "load_avg": [load_before, list(os.getloadavg())], "sample_reply": sample,
                                     "worker_stats": {workers[u]: a["prefix_cache"] for u, a in after.items()}})
                log(f"  {policy}: hit rate {s.hit_rate:.1%}, TTFT p50 {s.ttft_p50_s:.2f} s, {wall_s:.0f} s, "
                    f"load avg {os.getloadavg()[0]:.1f}")
        problems = _scan_logs(logs)
    names = [f"w{i}" for i in range(1, NUM_WORKERS + 1)]
    summaries = {p: summarize(p, results[p], names, sum(run["summary"]["wall_s"] for run in runs[p]))
                 for p in policies}
    details = {p: {"hit_rate_workers": (sum(run["worker_hits"][0] for run in runs[p])
                                        / max(1, sum(run["worker_hits"][1] for run in runs[p]))),
                   "rounds": runs[p], "results": [asdict(r) for r in sorted(results[p], key=lambda r: (r.round,
                                                                                                    r.sent_at))]}
               for p in policies}
    total_s = time.perf_counter() - started
    machine["load_avg_end"] = list(os.getloadavg())
    machine["mem_available_gib_end"] = mem_available_gib()
    checks = check_targets(summaries)
    held = targets_by_round(rounds)
    for c in checks:
        c["met_in_rounds"] = f"{sum(held[c['target']])}/{len(rounds)}"

    print(f"\nedgeserve bench routing  {tenants} tenants x {conversations} conversations x {turns} turns, "
          f"{args.users} users ({args.turn_order}), {NUM_WORKERS} workers x 1 thread, KV {args.kv_cache_bytes} each"
          f"{' (quick)' if quick else ''}")
    print(f"machine: {machine['cpus_usable']} CPUs shared by 4 workers, the gateway, Redis and the load generator "
          f"(CPU-starved: compare policies, not absolute numbers); load average "
          f"{machine['load_avg_start'][0]:.1f} at start, {machine['load_avg_end'][0]:.1f} at end")
    print_table(summaries, details)
    print("hit rate: cached / prompt tokens from the usage chunks ((workers): their /stats counters); TTFT: client "
          "clock to the first content chunk; same wkr: later turns on the worker of the previous turn")
    print(f"hit-rate ceiling for this workload (one infinite cache shared by all workers): {ceiling:.1%}")
    per_round = {p: {f: [run["summary"][f] for run in runs[p]] for f in ("hit_rate", "ttft_p50_s", "ttft_p95_s")}
                 for p in policies}
    print(f"{len(order)} rounds, policies in rotated order ({' | '.join(', '.join(o) for o in order)}); figures "
          f"pooled over rounds; per round [median, min, max]:")
    for p in policies:
        print(f"  {p:<14} hit rate " + ", ".join(f"{100 * v:.1f}%" for v in per_round[p]["hit_rate"])
              + "; TTFT p50 " + ", ".join(f"{v:.2f}" for v in per_round[p]["ttft_p50_s"]) + " s")
    for c in checks:
        print(f"  {'met   ' if c['met'] else 'MISSED'}  {c['target']}: {c['value']:.3f} vs {c['threshold']:.3f}"
              f" (met in {c['met_in_rounds']} rounds)"
              + ("  (above the ceiling: no router can meet it here)" if c["target"].startswith("hit rate")
                 and c["threshold"] > ceiling else ""))
    if problems:
        print(f"log lines with warnings/errors: {sum(len(v) for v in problems.values())} (see JSON 'log_problems')")
    print(f"cold caches: workers and gateway restarted per policy and round; took {total_s:.0f} s")

    by = lambda field: {p: getattr(s, field) for p, s in summaries.items()}  # noqa: E731
    report = {
        "quick": quick,
        "machine": machine,
        "config": {"model": MODEL, "policies": policies, "workers": NUM_WORKERS, "worker_threads": 1,
                   "kv_cache_bytes": args.kv_cache_bytes, "tenants": tenants, "conversations_per_tenant":
                   conversations, "turns": turns, "users": args.users, "turn_order": args.turn_order,
                   "max_tokens": args.max_tokens, "load_slack": args.load_slack,
                   "load_slack_share": args.load_slack_share, "recompute_weight": args.recompute_weight,
                   "temperature": 0, "system_words": args.system_words, "seed": args.seed,
                   "first_turn_prompt_tokens_mean": first_turn_tokens,
                   "prompt_tokens_mean": _mean([len(ids) for _, ids in prompts]),
                   "cold_caches": "workers and gateway restarted for each policy in each round",
                   "rounds": len(order), "order": order,
                   "assistant_messages": "scripted (a sentence of the tenant's document), not the model's reply",
                   "ttft": "client clock, request sent -> first chunk with content"},
        "hit_rate": by("hit_rate"),
        "hit_rate_workers": {p: d["hit_rate_workers"] for p, d in details.items()},
        "hit_rate_ceiling": ceiling,
        "hit_rate_by_turn": by("hit_rate_by_turn"),
        "ttft_p50_s": by("ttft_p50_s"),
        "ttft_p95_s": by("ttft_p95_s"),
        "latency_p50_s": by("latency_p50_s"),
        "requests_per_s": by("requests_per_s"),
        "output_tok_s": by("output_tok_s"),
        "requests_per_worker": by("requests_per_worker"),
        "computed_prompt_tokens_per_worker": by("computed_tokens_per_worker"),
        "max_over_mean_load": by("max_over_mean_load"),
        "max_over_mean_computed_tokens": by("max_over_mean_computed"),
        "same_worker_as_previous_turn": by("same_worker_rate"),
        "router_overlap_agreement": by("overlap_agreement"),
        "errors": by("errors"),
        "wall_s": by("wall_s"),
        "targets": checks,
        "per_round": per_round,
        "per_round_spread": {p: {f: spread(v) for f, v in figs.items()} for p, figs in per_round.items()},
        "headline": {**{f"hit_rate_{p}": summaries[p].hit_rate for p in policies},
                     **{f"ttft_p50_s_{p}": summaries[p].ttft_p50_s for p in policies}},
        "policy_runs": details,
        "log_problems": problems,
        "total_s": total_s,
    }
    path = write_report(args.json_path, report)
    png = path.with_suffix(".png")
    title = f"routing policies, {NUM_WORKERS} workers on {machine['cpus_usable']} shared CPUs"
    if plot_summaries(summaries, png, title):
        print(f"wrote {png}")
    return 0
