"""`edgeserve bench pd`'s report: the JSON of the phases that ran, their targets, the printed tables and
the plot (interference gaps and shared-prefix TTFT)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ops.bench.harness import plot
from ops.bench.harness.stats import ratio
from ops.bench.pd.measures import check, check_paired, latency_stats, window_gaps
from ops.bench.pd.client import is_idle
from ops.bench.pd.phases import LONG_OFFSET_S, round_order
from ops.bench.pd.store import print_store
from ops.bench.pd.transport import print_transport
from ops.bench.pd.workers import worker_specs

__all__ = ["THEORETICAL_WIRE_RATIO", "build_report", "print_tables", "plot_result"]

THEORETICAL_WIRE_RATIO = 128 / 65  # bf16 2 * head_dim bytes vs fp8 head_dim + 1, head_dim 64


def _pooled(rounds: list[dict[str, Any]], config: str) -> dict[str, Any]:
    mine = [r for r in rounds if r["config"] == config]
    windows = [(r["records"], r["start"], r["end"]) for r in mine]
    return {"short": latency_stats("short", *windows), "long": latency_stats("long", *windows),
            "output_tok_s": sum(r["output_tok_s"] for r in mine) / len(mine), "rounds": len(mine),
            "per_round_short_tpot_p95_s": [r["short"]["tpot_p95_s"] for r in mine],
            "per_round_short_ttft_p50_s": [r["short"]["ttft_p50_s"] for r in mine],
            "per_round_output_tok_s": [r["output_tok_s"] for r in mine],
            "idle_after_every_round": all(r["idle_after"]["ok"] for r in mine)}


def build_report(args, quick, machine, loads, mixed, pairs, prefix, wire, result, problems, total_s) -> dict[str, Any]:
    """The JSON report of the phases that ran (a phase left out by --phases has no keys)."""
    strip = lambda d: {k: v for k, v in d.items() if k not in ("records", "start", "end")}  # noqa: E731
    out: dict[str, Any] = {
        "quick": quick, "model": args.model, "machine": machine, "phases": loads,
        "settings": {"phases": args.phases, "kv_transport": args.kv_transport, "seed": args.seed,
                     "workers": worker_specs(args.model, args.kv_transport),
                     "clocks": "TTFT: client, sent -> first token event; TPOT: worker per-token times, pooled gaps",
                     "prompts": "synthetic token ids from seeded RNGs, uniform in [100, 40000)"},
        "targets": {}, "ttft_p50_s": {},
    }
    if "mixed_rounds" in result:
        pooled = {c: _pooled(result["mixed_rounds"], c) for c in ("unified", "disaggregated")}
        tpot = {c: pooled[c]["short"]["tpot_p95_s"] for c in pooled}
        out["settings"]["mixed"] = asdict(mixed) | {"pairs": pairs, "order": round_order(pairs),
                                                   "long_first_at_s": LONG_OFFSET_S}
        out["settings"]["mixed_requests"] = ("sent in the window: TTFT; once all have a first token the rest are "
                                             "cancelled, so few finish (`finished`, `worker_ttft_p50_s` count only "
                                             "those that did)")
        out["targets"]["mixed"] = check("short TPOT p95 disaggregated / unified",
                                        ratio(tpot["disaggregated"], tpot["unified"]), "<", 1.0)
        out |= {"tpot_p95_s": tpot, "mixed": pooled, "mixed_rounds": [strip(r) for r in result["mixed_rounds"]],
                "idle_checks": result["idle_checks"]}
    if "prefix" in result:
        pre = result["prefix"]
        out["ttft_p50_s"] |= {k: pre[k]["ttft_p50_s"] for k in pre}
        out["settings"]["shared_prefix"] = prefix
        out["targets"]["prefix"] = check("TTFT p50 cache on / off", ratio(out["ttft_p50_s"]["prefix_cache_on"],
                                                                          out["ttft_p50_s"]["prefix_cache_off"]),
                                         "<=", 0.3)
        out |= {"prefix_hit_rate": pre["prefix_cache_on"]["hit_rate"],
                "shared_prefix": {k: strip(v) for k, v in pre.items()}}
    if "wire" in result:
        w = result["wire"]
        bpt = {k: w[k]["decode_side"]["bytes_per_token"] for k in w}
        out["settings"]["wire"] = wire
        out["targets"]["wire"] = check("transfer bytes per token bf16 / fp8", ratio(bpt["bf16"], bpt["fp8_e4m3"]),
                                       ">=", 1.9)
        out |= {"transfer_bytes_per_token": bpt, "transfer_bytes_ratio_bf16_over_fp8": ratio(bpt["bf16"],
                                                                                           bpt["fp8_e4m3"]),
                "transfer_bytes_ratio_theoretical": THEORETICAL_WIRE_RATIO, "wire": w}
    if "transport" in result:
        tr = result["transport"]
        out["ttft_p50_s"] |= {f"{t}_{n}": v for t, by_n in tr["ttft_p50_s"].items() for n, v in by_n.items()}
        out["targets"]["transport"] = check_paired("KV transfer ms at 1024 tokens http / mooncake",
                                                   tr["transfer_ratio_paired"][1024], ">=", 2.0)
        out |= {"transfer_ms": tr["transfer_ms"], "transport": tr}
    if "store" in result:
        st = result["store"]
        out["ttft_p50_s"] |= {"store_hit": st["store_hit_p50_s"], "store_miss": st["store_miss_p50_s"]}
        out["targets"]["store"] = check("TTFT p50 store hit / recompute", ratio(st["store_hit_p50_s"],
                                                                                st["store_miss_p50_s"]), "<=", 0.5)
        out["store"] = st
    out |= {"final_worker_stats": result["final_stats"], "worker_log_problems": problems, "total_s": total_s}
    return out


def print_tables(r: dict[str, Any]) -> None:
    ms = lambda v: f"{1e3 * v:.0f}"  # noqa: E731
    verdict = lambda t: (f"{t['name']} = {t['value']:.3f}"  # noqa: E731
                         + (" [{:.3f}, {:.3f}]".format(*t["ci95"]) if "ci95" in t else "")
                         + f" (target {t['rule']} {t['threshold']:g}): "
                         + t.get("verdict", "met" if t["met"] else "missed").upper())
    m = r["machine"]
    print(f"\nedgeserve bench pd  model={r['model']}{' (quick)' if r['quick'] else ''}  {m['cpus_usable']} CPUs "
          f"({m['cpu_model']}), load avg (1 min) "
          f"{' -> '.join(str(p['load_1_5_15'][0]) for p in r['phases'].values())} over the phases; "
          f"took {r['total_s']:.0f} s")
    if "mixed" in r:
        _print_mixed(r, verdict, ms)
    if "shared_prefix" in r:
        _print_prefix(r, verdict, ms)
    if "wire" in r:
        _print_wire(r, verdict)
    if "transport" in r:
        print_transport(r["transport"])
        print(verdict(r["targets"]["transport"]))
    if "store" in r:
        print_store(r["store"])
        print(verdict(r["targets"]["store"]))
    idle_bad = ([k for k, v in r.get("idle_checks", {}).items() if not v["ok"]]
                + [f"mixed round {x['round'] + 1}" for x in r.get("mixed_rounds", []) if not x["idle_after"]["ok"]]
                + [f"wire {k}" for k, v in r.get("wire", {}).items() if not v["idle_after"]["ok"]]
                + [k for k, v in r.get("shared_prefix", {}).items() if not v["idle_after"]["ok"]]
                + [f"{k} when stopped" for k, v in r["final_worker_stats"].items() if not is_idle(v)])
    logged = {k: v["count"] for k, v in r["worker_log_problems"].items() if v["count"]}
    print(f"\nworkers idle with every page back: {'yes' if not idle_bad else 'NO: ' + ', '.join(idle_bad)}; "
          f"warnings/errors in worker logs: {logged or 'none'}")


def _print_mixed(r: dict[str, Any], verdict: Callable, ms: Callable) -> None:
    s = r["settings"]
    mx = s["mixed"]
    print(f"\n1) mixed: {mx['short_clients']} closed-loop clients x ({mx['short_prompt']} + {mx['short_output']} "
          f"tokens) + a {mx['long_prompt']} + {mx['long_output']} prompt every {mx['long_interval_s']:g} s; rounds "
          f"{' '.join(c[0].upper() for c in mx['order'])} of {mx['duration_s']:g} s (pooled); ms unless noted")
    print(f"{'config':<15}{'TTFT p50':>9}{'p95':>7}{'TPOT p50':>10}{'p95':>7}{'  p95/round':<16}{'long TTFT':>10}"
          f"{'tok/s':>7}{'short':>7}{'long':>6}{'errors':>8}")
    for c, p in r["mixed"].items():
        sh, lo = p["short"], p["long"]
        print(f"{c:<15}{ms(sh['ttft_p50_s']):>9}{ms(sh['ttft_p95_s']):>7}{ms(sh['tpot_p50_s']):>10}"
              f"{ms(sh['tpot_p95_s']):>7}  {','.join(ms(v) for v in p['per_round_short_tpot_p95_s']):<14}"
              f"{lo['ttft_p50_s']:>9.2f}s{p['output_tok_s']:>7.1f}{sh['requests']:>7}{lo['requests']:>6}"
              f"{sh['errors'] + lo['errors']:>8}")
    print(verdict(r["targets"]["mixed"]))


def _print_prefix(r: dict[str, Any], verdict: Callable, ms: Callable) -> None:
    s = r["settings"]
    sp = s["shared_prefix"]
    print(f"\n2) shared prefix: {sp['requests']} requests, {sp['prefix_tokens']}-token system prompt shared by "
          f"{100 * sp['shared']:.0f}%, + {sp['suffix_tokens']} unique, {sp['output_tokens']} output, concurrency "
          f"{sp['concurrency']}, unified --threads 2")
    print(f"{'prefix cache':<18}{'TTFT p50 ms':>12}{'p95 ms':>9}{'hit rate':>10}{'requests':>10}{'errors':>8}")
    for name, p in r["shared_prefix"].items():
        hit = "-" if p["hit_rate"] is None else f"{p['hit_rate']:.3f}"
        print(f"{name:<18}{ms(p['ttft_p50_s']):>12}{ms(p['ttft_p95_s']):>9}{hit:>10}{p['requests']:>10}"
              f"{p['errors']:>8}")
    print(verdict(r["targets"]["prefix"]))


def _print_wire(r: dict[str, Any], verdict: Callable) -> None:
    s = r["settings"]
    print(f"\n3) KV wire: {s['wire']['requests']} requests of {s['wire']['prompt_tokens']} prompt tokens per format")
    print(f"{'wire':<10}{'B/token (decode)':>18}{'B/token (prefill sent)':>24}{'transfers':>11}{'failed':>8}")
    for fmt, p in r["wire"].items():
        d, pf = p["decode_side"], p["prefill_side"]
        print(f"{fmt:<10}{d['bytes_per_token']:>18.1f}{pf['bytes_per_token']:>24.1f}{d['transfers']:>11}"
              f"{d['failed']:>8}")
    print(verdict(r["targets"]["wire"]) + f"  (theory {THEORETICAL_WIRE_RATIO:.3f})")


def plot_result(result: dict[str, Any], path: Path) -> bool:
    plt = plot.pyplot()
    if plt is None:
        return False

    if "mixed_rounds" not in result or "prefix" not in result:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for config in ("unified", "disaggregated"):
        gaps = sorted(1e3 * g for r in result["mixed_rounds"] if r["config"] == config for rec in r["records"]
                      if rec.kind == "short" for g in window_gaps(rec, r["start"], r["end"]))
        left.plot(gaps, [(i + 1) / len(gaps) for i in range(len(gaps))], label=config)
    left.set_xscale("log")
    left.set_xlabel("short request inter-token gap (ms, worker clock)")
    left.set_ylabel("fraction of gaps")
    left.axhline(0.95, color="gray", lw=0.5)
    for name, p in result["prefix"].items():
        ttfts = sorted(1e3 * rec.ttft_s for rec in p["records"] if rec.ttft_s is not None)
        right.plot(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], label=name)
    right.set_xscale("log")
    right.set_xlabel("shared-prefix TTFT (ms, client clock)")
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
        ax.legend()
    return plot.save(fig, "bench pd: interference (left), prefix cache (right)", path, dpi=110)
