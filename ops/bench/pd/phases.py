"""`edgeserve bench pd`'s phases against running workers: mixed (interference: closed-loop short
requests with long prompts arriving open loop, unified against disaggregated in alternating rounds),
wire (KV bytes per token per wire format) and shared prefix (the prefix cache on against off)."""

from __future__ import annotations

import asyncio
import gc
import itertools
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ops.bench.harness.machine import load_average
from ops.bench.harness.prompts import random_ids
from ops.bench.harness.stats import ratio
from ops.bench.pd.client import (RequestRecord, closed_loop, hit_rate_delta, send, stats, transfer_delta,
                                 wait_idle)
from ops.bench.pd.measures import compact, latency_stats, window_tok_s

__all__ = ["MixedSettings", "LONG_OFFSET_S", "round_order", "shared_prefix_prompts", "mixed_round", "warm_up",
           "mixed_phase", "wire_phase", "prefix_phase", "idle_summary"]

LONG_OFFSET_S = 1.0  # the first long prompt arrives this long into a round


def round_order(pairs: int, a: str = "unified", b: str = "disaggregated") -> list[str]:
    """A B B A A B ...: each pair of rounds has both configurations, the first mover alternating."""
    return [x for i in range(pairs) for x in ((a, b) if i % 2 == 0 else (b, a))]


def shared_prefix_prompts(n: int, prefix_tokens: int, suffix_tokens: int, shared: float,
                          seed: int) -> list[tuple[list[int], bool]]:
    """(prompt, shares the system prompt) for n requests: round(shared * n) of them, RNG-chosen, share it."""
    rng = random.Random(seed)
    system = random_ids(rng, prefix_tokens)
    own = set(rng.sample(range(n), n - round(shared * n)))
    return [((random_ids(rng, prefix_tokens) if i in own else system) + random_ids(rng, suffix_tokens), i not in own)
            for i in range(n)]


@dataclass
class MixedSettings:
    duration_s: float
    short_clients: int
    short_prompt: int
    short_output: int
    long_prompt: int
    long_output: int
    long_interval_s: float
    ramp_s: float
    drain_cap_s: float = 60.0


async def mixed_round(url: str, s: MixedSettings, tag: str) -> tuple[list[RequestRecord], float, float]:
    """One round: the short clients start one by one over `ramp_s` (unmeasured), then a window of
    `duration_s` with long prompts arriving open loop; (records, start, end of the window)."""
    from backend.worker_client import WorkerClient

    client = WorkerClient(url)
    records: list[RequestRecord] = []
    tasks: list[asyncio.Task] = []
    load_start = time.perf_counter()
    start = load_start + s.ramp_s
    end = start + s.duration_s

    def launch(kind: str, prompt: list[int], out: int, rid: str) -> asyncio.Task:
        now = time.perf_counter()
        rec = RequestRecord(kind, now, len(prompt), measured=start <= now < end)
        records.append(rec)
        tasks.append(asyncio.create_task(send(client, rec, prompt, out, f"{tag}-{rid}")))
        return tasks[-1]

    async def short_user(u: int) -> None:
        await asyncio.sleep(u * s.ramp_s / s.short_clients)  # staggered, so requests do not move in lockstep
        for i in itertools.count():
            await launch("short", random_ids(random.Random(f"short-{u}-{i}"), s.short_prompt), s.short_output,
                         f"s{u}.{i}")

    async def long_arrivals() -> None:
        for k in itertools.count():
            at = start + LONG_OFFSET_S + k * s.long_interval_s
            if at >= end:
                return
            await asyncio.sleep(at - time.perf_counter())
            launch("long", random_ids(random.Random(f"long-{k}"), s.long_prompt), s.long_output, f"l{k}")

    users = [asyncio.create_task(short_user(u)) for u in range(s.short_clients)]
    await long_arrivals()
    await asyncio.sleep(max(0.0, end - time.perf_counter()))
    cap = time.perf_counter() + s.drain_cap_s
    while time.perf_counter() < cap and any(r.measured and r.ttft_s is None and r.error is None for r in records):
        await asyncio.sleep(0.05)  # every request sent in the window has its first token; the load goes on
    for task in users + tasks:  # the rest end as a client that leaves
        task.cancel()
    await asyncio.gather(*users, *tasks, return_exceptions=True)
    for rec in records:
        if rec.measured and rec.ttft_s is None and rec.error is None:
            rec.error = f"no first token within the {s.drain_cap_s:.0f} s drain cap"
    await client.aclose()
    return records, start, end


async def warm_up(urls: list[str], long_prompt: int, seed: int, log: Callable[[str], None]) -> None:
    """A short and a long request through each entry point (first-request costs out of the figures)."""
    rng = random.Random(seed)
    warm = [closed_loop(u, [random_ids(rng, 64), random_ids(rng, long_prompt)], 4, 2, "warmup", f"warm-{i}")
            for i, u in enumerate(urls)]
    for recs in await asyncio.gather(*warm):
        for r in recs:
            if not r.ok:
                log(f"warning: warm-up request failed: {r.error}")


async def mixed_phase(urls: dict[str, str], mixed: MixedSettings, pairs: int, mark: Callable[[str], None],
                 log: Callable[[str], None]) -> dict[str, Any]:
    entry = {"unified": urls["unified"], "disaggregated": urls["decode"]}
    members = {"unified": [urls["unified"]], "disaggregated": [urls["decode"], urls["prefill"]]}
    await warm_up(list(entry.values()), mixed.long_prompt, 1, log)
    idle = {"after_warmup": idle_summary(await wait_idle([urls["unified"], urls["decode"], urls["prefill"]]))}
    mark("after_warmup")
    rounds = []
    for i, config in enumerate(round_order(pairs)):
        before = {u: await stats(u) for u in members[config]}
        gc.collect()
        gc.disable()
        records, start, end = await mixed_round(entry[config], mixed, f"r{i}-{config[:3]}")
        gc.enable()
        done = await wait_idle(members[config])
        after = done["stats"]
        row = {"round": i, "config": config, "short": latency_stats("short", (records, start, end)),
               "long": latency_stats("long", (records, start, end)), "output_tok_s": window_tok_s(records, start, end),
               "idle_after": idle_summary(done), "load": load_average(2), "requests": compact(records, start),
               "kv_transfer": {name: transfer_delta(before[u]["kv_transfer"], after[u]["kv_transfer"])
                               for name, u in (("decode", urls["decode"]), ("prefill", urls["prefill"]))
                               if u in before}}
        rounds.append({**row, "records": records, "start": start, "end": end})
        sh = row["short"]
        log(f"mixed round {i + 1}/{2 * pairs} {config:<13}: short TPOT p95 {1e3 * sh['tpot_p95_s']:6.0f} ms, "
            f"TTFT p50 {1e3 * sh['ttft_p50_s']:6.0f} ms ({sh['requests']} req), long TTFT p50 "
            f"{row['long']['ttft_p50_s']:.2f} s ({row['long']['requests']} req), {row['output_tok_s']:.1f} tok/s, "
            f"errors {sh['errors'] + row['long']['errors']}, idle {'ok' if done['ok'] else 'NOT REACHED'}, "
            f"load {row['load'][0]}")
    return {"mixed_rounds": rounds, "idle_checks": idle}


async def wire_phase(urls: dict[str, str], wire: dict[str, Any], seed: int,
                     log: Callable[[str], None]) -> dict[str, Any]:
    await warm_up([urls["decode_bf16"]], wire["prompt_tokens"], 2, log)
    rng = random.Random(seed)
    prompts = [random_ids(rng, wire["prompt_tokens"]) for _ in range(wire["requests"])]
    out = {}
    for fmt, url in (("fp8_e4m3", urls["decode"]), ("bf16", urls["decode_bf16"])):
        before = {u: await stats(u) for u in (url, urls["prefill"])}
        records = await closed_loop(url, prompts, wire["output_tokens"], 1, "wire", f"wire-{fmt}")
        idle = await wait_idle([url, urls["prefill"]])
        after = idle["stats"]
        d = transfer_delta(before[url]["kv_transfer"], after[url]["kv_transfer"])
        p = transfer_delta(before[urls["prefill"]]["kv_transfer"], after[urls["prefill"]]["kv_transfer"])
        out[fmt] = {"decode_side": d, "prefill_side": p, "errors": sum(not r.ok for r in records),
                    "pool_bytes_per_token": after[url]["kv_bytes_per_token"], "idle_after": idle_summary(idle)}
        log(f"wire {fmt:<9}: {d['bytes_per_token']:.1f} B/token on the decode side, {p['bytes_per_token']:.1f} "
            f"sent by the prefill worker, {d['transfers']} transfers, {d['failed']} failed")
    return out


async def prefix_phase(urls: dict[str, str], prefix: dict[str, Any], seed: int,
                  log: Callable[[str], None]) -> dict[str, Any]:
    await warm_up([urls["unified"], urls["unified_cache"]], prefix["prefix_tokens"], 3, log)
    prompts = shared_prefix_prompts(prefix["requests"], prefix["prefix_tokens"], prefix["suffix_tokens"],
                                    prefix["shared"], seed)
    out = {}
    for name, url in (("prefix_cache_on", urls["unified_cache"]), ("prefix_cache_off", urls["unified"])):
        before = await stats(url)
        gc.collect()
        gc.disable()
        t0 = time.perf_counter()
        records = await closed_loop(url, [p for p, _ in prompts], prefix["output_tokens"], prefix["concurrency"],
                                    "prefix", name)
        seconds = time.perf_counter() - t0
        gc.enable()
        idle = await wait_idle([url])
        after = idle["stats"][url]
        pc_before, pc_after = before.get("prefix_cache"), after.get("prefix_cache")
        st = latency_stats("prefix", (records, -math.inf, math.inf))
        out[name] = {
            **st, "seconds": seconds,
            "hit_rate": hit_rate_delta(pc_before, pc_after) if pc_before and pc_after else None,
            "hit_rate_cumulative": pc_after["hit_rate"] if pc_after else None,
            "client_cached_fraction": ratio(sum(r.cached_tokens for r in records),
                                            sum(r.prompt_tokens for r in records)),
            "prefix_cache_after": pc_after, "idle_after": idle_summary(idle), "records": records}
        log(f"shared prefix {name:<16}: TTFT p50 {st['ttft_p50_s']:.3f} s p95 {st['ttft_p95_s']:.3f} s, "
            f"{st['requests']} req in {seconds:.0f} s, hit rate {out[name]['hit_rate']}, errors {st['errors']}")
    return out


def idle_summary(idle: dict[str, Any]) -> dict[str, Any]:
    keys = ("running", "waiting", "held", "pages_used", "pages_free", "pages_total")
    return {"ok": idle["ok"], "seconds": round(idle["seconds"], 2),
            "workers": {u: {k: s.get(k) for k in keys} | {"cached_blocks": (s.get("prefix_cache") or {}).get("blocks")}
                        for u, s in idle["stats"].items()}}
