"""`edgeserve bench pd`'s KV transport phase: HTTP frames against Mooncake direct writes, one run.

Workers (SmolLM2, float32 compute, one thread each): one prefill worker with an FP8
pool (``--kv-format fp8_e4m3``: a direct write copies pool bytes as they are, so both
pools must hold the same format) and two decode workers pointing at it, identical but
for ``--kv-transport http`` and ``--kv-transport mooncake`` (TCP on loopback).

For each prompt length (256 and 1,024 tokens; 6 requests each, quick or not) the
two transports take turns request by request (the first mover alternating), one
request at a time, every prompt unique (no prefix cache on either side), greedy with
one output token, so the decode worker's work is the transfer plus one step.
Per request:

- transfer ms: the decode worker's `/stats` ``layer_seconds`` delta (KVBegin ->
  KVEnd received: every layer read, moved and installed or checked; the prefill's
  compute is before KVBegin and not in it);
- decode-worker CPU s: the decode process's user + system CPU time delta
  (`/proc/PID/stat`), the transfer's receive-side cost (socket reads and frame
  parsing and installs for HTTP; the Transfer Engine's receiving threads and the
  tag checks for Mooncake) plus the same single decode step on both;
- TTFT: client clock, request sent -> first token.

Medians over the requests are reported. The headline is http / mooncake of transfer ms at 1,024 tokens
(target >= 2), taken pair by pair (request i of each transport, sent one after the other) as the median of
the pairs' ratios with a 95% bootstrap interval; the target is judged on the interval. With 2 requests each
(the quick run until 2026-12-07) the ratio read 1.77-2.96x in seven runs of one tree on one VM, so a lone
figure either side of 2 said nothing.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from ops.bench.harness.procs import process_cpu_s
from ops.bench.harness.prompts import random_ids
from ops.bench.harness.stats import median_ratio
from ops.bench.pd.client import RequestRecord, send, stats, wait_idle

__all__ = ["TRANSPORT_WORKERS", "transport_phase", "paired_ratio"]

TRANSPORT_WORKERS = {  # name -> (edgeserve serve flags, the prefill worker it points at)
    "prefill_fp8": ["--role", "prefill", "--threads", "1", "--kv-format", "fp8_e4m3", "--kv-cache-bytes", "128M"],
    "decode_http": ["--role", "decode", "--threads", "1", "--kv-format", "fp8_e4m3", "--kv-cache-bytes", "128M",
                    "--kv-transport", "http"],
    "decode_mooncake": ["--role", "decode", "--threads", "1", "--kv-format", "fp8_e4m3", "--kv-cache-bytes", "128M",
                        "--kv-transport", "mooncake"],
}
TRANSPORTS = {"http": "decode_http", "mooncake": "decode_mooncake"}


async def transport_phase(urls: dict[str, str], pids: dict[str, int], lengths: tuple[int, ...], requests: int,
                          seed: int, log: Callable[[str], None]) -> dict[str, Any]:
    """Both transports, interleaved request by request (see the module docstring)."""
    from backend.worker_client import WorkerClient

    rng = random.Random(seed)
    clients = {t: WorkerClient(urls[w]) for t, w in TRANSPORTS.items()}
    rows: dict[str, dict[int, list[dict[str, float]]]] = {t: {n: [] for n in lengths} for t in TRANSPORTS}
    errors: list[str] = []
    try:
        for t in TRANSPORTS:  # warm-up: first-request costs (connections, the Transfer Engine's handshake)
            await send(clients[t], RequestRecord("warm", 0.0, 64), random_ids(rng, 64), 1, f"warm-{t}")
        for n in lengths:
            for i in range(requests):
                order = list(TRANSPORTS) if i % 2 == 0 else list(reversed(TRANSPORTS))
                for t in order:
                    w = TRANSPORTS[t]
                    before, cpu0 = (await stats(urls[w]))["kv_transfer"], process_cpu_s(pids[w])
                    rec = await send(clients[t], RequestRecord("kv", 0.0, n), random_ids(rng, n), 1, f"kv-{t}-{n}-{i}")
                    await wait_idle([urls[w]])
                    cpu1, after = process_cpu_s(pids[w]), (await stats(urls[w]))["kv_transfer"]
                    if rec.error or after["transfers"] - before["transfers"] != 1:
                        errors.append(f"{t} {n}: {rec.error or 'no transfer counted'}")
                        continue
                    rows[t][n].append({"i": i, "transfer_ms": 1e3 * (after["layer_seconds"] - before["layer_seconds"]),
                                       "ttft_s": rec.ttft_s, "decode_cpu_s": cpu1 - cpu0,
                                       "bytes": after["bytes"] - before["bytes"],
                                       "direct": after.get("direct", 0) - before.get("direct", 0)})
            log(f"kv transport {n:>5} tokens: " + ", ".join(
                f"{t} {statistics.median(r['transfer_ms'] for r in rows[t][n]):.1f} ms" for t in TRANSPORTS
                if rows[t][n]))
    finally:
        for c in clients.values():
            await c.aclose()
    med = lambda t, n, k: statistics.median(r[k] for r in rows[t][n]) if rows[t][n] else float("nan")  # noqa: E731
    out = {
        "transfer_ms": {t: {n: med(t, n, "transfer_ms") for n in lengths} for t in TRANSPORTS},
        "decode_cpu_s_per_transfer": {t: {n: med(t, n, "decode_cpu_s") for n in lengths} for t in TRANSPORTS},
        "ttft_p50_s": {t: {n: med(t, n, "ttft_s") for n in lengths} for t in TRANSPORTS},
        "bytes_per_transfer": {t: {n: med(t, n, "bytes") for n in lengths} for t in TRANSPORTS},
        "direct_transfers": {t: sum(r["direct"] for n in lengths for r in rows[t][n]) for t in TRANSPORTS},
        "requests": rows, "errors": errors, "at": time.time(),
    }
    out["transfer_ratio_http_over_mooncake"] = {
        n: out["transfer_ms"]["http"][n] / out["transfer_ms"]["mooncake"][n] for n in lengths
        if out["transfer_ms"]["mooncake"][n] > 0}
    out["transfer_ratio_paired"] = {n: paired_ratio(rows["http"][n], rows["mooncake"][n]) for n in lengths}
    return out


def paired_ratio(a: list[dict[str, float]], b: list[dict[str, float]]) -> dict[str, Any]:
    """Median over requests i of a's transfer ms / b's (both transports' request i, sent one after the other;
    a request that failed on either side drops its pair), with a 95% interval (`median_ratio`)."""
    by_i = {r["i"]: r["transfer_ms"] for r in b}
    pairs = [(r["transfer_ms"], by_i[r["i"]]) for r in a if r["i"] in by_i and by_i[r["i"]] > 0]
    if not pairs:
        return {"median": float("nan"), "ci95": [float("nan"), float("nan")], "pairs": 0}
    return median_ratio([x for x, _ in pairs], [y for _, y in pairs]) | {"pairs": len(pairs)}


def print_transport(r: dict[str, Any]) -> None:
    """The phase's table."""
    lengths = list(r["transfer_ms"]["http"])
    print("\n4) KV transport: prefill (fp8 pool) -> decode over HTTP frames vs Mooncake direct writes (TCP loopback); "
          "medians per request")
    print(f"{'transport':<10}{'tokens':>7}{'transfer ms':>13}{'decode CPU ms':>15}{'TTFT ms':>9}{'bytes':>10}")
    for t in r["transfer_ms"]:
        for n in lengths:
            print(f"{t:<10}{n:>7}{r['transfer_ms'][t][n]:>13.1f}{1e3 * r['decode_cpu_s_per_transfer'][t][n]:>15.1f}"
                  f"{1e3 * r['ttft_p50_s'][t][n]:>9.0f}{r['bytes_per_transfer'][t][n]:>10.0f}")
    ratios = ", ".join(f"{n}: {v['median']:.2f}x [{v['ci95'][0]:.2f}, {v['ci95'][1]:.2f}] over {v['pairs']} pairs"
                       for n, v in r["transfer_ratio_paired"].items())
    print(f"transfer time http / mooncake: {ratios}; direct transfers {r['direct_transfers']}; "
          f"errors {len(r['errors'])}")
