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
import contextlib
import gc
import itertools
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ops.bench.report import write_report
from ops.bench.harness.stats import percentile
from ops.bench_pd_kv import TRANSPORT_WORKERS, print_transport, transport_phase
from ops.bench_pd_store import print_store
from ops.cluster import child_process, machine_info, wait_http

if TYPE_CHECKING:
    from backend.worker_client import WorkerClient

__all__ = ["add_arguments", "run", "RequestRecord", "token_gaps", "window_gaps", "latency_stats", "window_tok_s",
           "check", "ratio", "transfer_delta", "hit_rate_delta", "shared_prefix_prompts", "round_order", "random_ids",
           "is_idle", "worker_specs"]

THEORETICAL_WIRE_RATIO = 128 / 65  # bf16 2 * head_dim bytes vs fp8 head_dim + 1, head_dim 64
PHASES = ("mixed", "wire", "prefix", "transport", "store")
LONG_OFFSET_S = 1.0  # the first long prompt arrives this long into a round
WORKER_GB = 2.7  # resident size of one worker here: weights, their MKL-packed copies (3 buckets), the KV pool


# ---------------------------------------------------------------- pure helpers

@dataclass
class RequestRecord:
    kind: str  # "short" | "long" | "prefix" | "wire" | "warmup"
    sent: float  # client perf_counter when the request was sent
    prompt_tokens: int
    measured: bool = True  # sent inside the measured window
    ttft_s: float | None = None  # client clock: sent -> first token event
    worker_times: list[float] = field(default_factory=list)  # per token, s since arrival at the worker
    arrivals: list[float] = field(default_factory=list)  # per token, client perf_counter
    finish_reason: str | None = None
    cached_tokens: int = 0
    worker_ttft_s: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.finish_reason is not None and self.error is None


def random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def token_gaps(times: list[float]) -> list[float]:
    """Seconds between consecutive tokens of one request."""
    return [b - a for a, b in zip(times, times[1:])]


def window_gaps(rec: RequestRecord, start: float, end: float, clock: str = "worker") -> list[float]:
    """Gaps before each token of `rec` that reached the client in [start, end]; measured on the
    worker's per-token times ("worker") or on the client's arrival clock ("client")."""
    times = rec.worker_times if clock == "worker" else rec.arrivals
    return [times[i] - times[i - 1] for i in range(1, len(times)) if start <= rec.arrivals[i] <= end]


Window = tuple[list[RequestRecord], float, float]  # one round's records and its measured window [start, end]


def latency_stats(kind: str, *windows: Window) -> dict[str, Any]:
    """Of the `kind` requests, pooled over windows: TTFT (client clock) of those sent in their window
    (`measured`), and TPOT: the gaps before every token that reached the client inside its window
    (worker clock; `tpot_client_*` on the arrival clock), whenever its request was sent."""
    sent = [r for recs, _, _ in windows for r in recs if r.kind == kind and r.measured]
    ttfts = [r.ttft_s for r in sent if r.ttft_s is not None]
    gaps, client_gaps = [], []
    for recs, start, end in windows:
        for r in recs:
            if r.kind == kind:
                gaps += window_gaps(r, start, end)
                client_gaps += window_gaps(r, start, end, "client")
    worker_ttfts = [r.worker_ttft_s for r in sent if r.worker_ttft_s is not None]
    return {"requests": len(ttfts), "finished": sum(r.ok for r in sent),
            "errors": sum(r.error is not None for r in sent),
            "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p95_s": percentile(ttfts, 0.95),
            "tpot_p50_s": percentile(gaps, 0.5), "tpot_p95_s": percentile(gaps, 0.95),
            "tpot_client_p50_s": percentile(client_gaps, 0.5), "tpot_client_p95_s": percentile(client_gaps, 0.95),
            "worker_ttft_p50_s": percentile(worker_ttfts, 0.5), "gaps": len(gaps)}


def window_tok_s(records: list[RequestRecord], start: float, end: float) -> float:
    """Tokens (of any request) that reached the client in [start, end], per second."""
    return sum(start <= t <= end for r in records for t in r.arrivals) / (end - start)


def check(name: str, value: float, rule: str, threshold: float) -> dict[str, Any]:
    """A target: `value rule threshold` with rule one of "<", "<=", ">="; NaN never meets it."""
    met = {"<": value < threshold, "<=": value <= threshold, ">=": value >= threshold}[rule]
    return {"name": name, "value": value, "rule": rule, "threshold": threshold, "met": bool(met)}


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def transfer_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """What a worker's `/stats` kv_transfer counters did between two snapshots."""
    d = {k: after[k] - before[k] for k in ("transfers", "failed", "bytes", "tokens", "seconds")}
    d["bytes_per_token"] = ratio(d["bytes"], d["tokens"])
    return d


def hit_rate_delta(before: dict[str, Any], after: dict[str, Any]) -> float:
    """Prefix-cache hit rate (hit tokens / query tokens) between two `/stats` prefix_cache snapshots."""
    return ratio(after["hit_tokens"] - before["hit_tokens"], after["query_tokens"] - before["query_tokens"])


def shared_prefix_prompts(n: int, prefix_tokens: int, suffix_tokens: int, shared: float,
                          seed: int) -> list[tuple[list[int], bool]]:
    """(prompt, shares the system prompt) for n requests: round(shared * n) of them, RNG-chosen, share it."""
    rng = random.Random(seed)
    system = random_ids(rng, prefix_tokens)
    own = set(rng.sample(range(n), n - round(shared * n)))
    return [((random_ids(rng, prefix_tokens) if i in own else system) + random_ids(rng, suffix_tokens), i not in own)
            for i in range(n)]


def round_order(pairs: int, a: str = "unified", b: str = "disaggregated") -> list[str]:
    """A B B A A B ...: each pair of rounds has both configurations, the first mover alternating."""
    return [x for i in range(pairs) for x in ((a, b) if i % 2 == 0 else (b, a))]


# ---------------------------------------------------------------- load generation

async def send(client: WorkerClient, rec: RequestRecord, prompt: list[int], max_tokens: int,
               request_id: str) -> RequestRecord:
    """One greedy request (EOS ignored) filling `rec` as events arrive; errors are recorded, not raised."""
    from backend.errors import EdgeServeError
    from backend.protocol import ErrorEvent, FinishEvent, GenerateRequest, TokenEvent
    from backend.sampling_params import SamplingParams

    req = GenerateRequest(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), request_id)
    rec.sent = time.perf_counter()
    try:
        async for ev in client.generate(req):
            now = time.perf_counter()
            if isinstance(ev, TokenEvent):
                if rec.ttft_s is None:
                    rec.ttft_s = now - rec.sent
                rec.worker_times += ev.times
                rec.arrivals += [now] * len(ev.token_ids)
            elif isinstance(ev, FinishEvent):
                rec.finish_reason, rec.cached_tokens, rec.worker_ttft_s = ev.finish_reason, ev.cached_tokens, ev.ttft_s
            elif isinstance(ev, ErrorEvent):
                rec.error = f"{ev.type} ({ev.code}): {ev.message}"
    except EdgeServeError as exc:
        rec.error = f"{type(exc).__name__} ({exc.code}): {exc.message}"
    return rec


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


def compact(records: list[RequestRecord], t0: float) -> list[dict[str, Any]]:
    """Every request of a round for the JSON: times in s after t0 (the window's start), gaps in ms (worker clock)."""
    r3 = lambda v: None if v is None else round(v, 3)  # noqa: E731
    return [{"kind": r.kind, "measured": r.measured, "sent_s": r3(r.sent - t0), "ttft_s": r3(r.ttft_s),
             "worker_ttft_s": r3(r.worker_ttft_s), "first_arrival_s": r3(r.arrivals[0] - t0) if r.arrivals else None,
             "finish": r.finish_reason, "error": r.error,
             "gaps_ms": [round(1e3 * g, 1) for g in token_gaps(r.worker_times)]}
            for r in records]


async def closed_loop(url: str, prompts: list[list[int]], max_tokens: int, concurrency: int, kind: str,
                      tag: str) -> list[RequestRecord]:
    """`concurrency` users take the prompts in order, one request at a time each."""
    from backend.worker_client import WorkerClient

    client = WorkerClient(url)
    todo = iter(enumerate(prompts))
    records: list[RequestRecord] = []

    async def user() -> None:
        for i, prompt in todo:
            rec = RequestRecord(kind, 0.0, len(prompt))
            records.append(rec)
            await send(client, rec, prompt, max_tokens, f"{tag}-{i}")

    await asyncio.gather(*(user() for _ in range(concurrency)))
    await client.aclose()
    return records


async def stats(url: str) -> dict[str, Any]:
    from backend.worker_client import WorkerClient

    client = WorkerClient(url)
    try:
        return await client.stats()
    finally:
        await client.aclose()


def is_idle(snap: dict[str, Any]) -> bool:
    """Nothing running, waiting or held, and every page free but those the prefix cache keeps."""
    cached = (snap.get("prefix_cache") or {}).get("blocks", 0)
    return snap["running"] == snap["waiting"] == snap["held"] == 0 and snap["pages_used"] == cached


async def wait_idle(urls: list[str], timeout_s: float = 10.0) -> dict[str, Any]:
    """Poll `/stats` until every worker is idle; {"ok", "seconds", "stats": {url: last snapshot}}."""
    started = time.perf_counter()
    while True:
        snaps = {u: await stats(u) for u in urls}
        ok = all(is_idle(s) for s in snaps.values())
        if ok or time.perf_counter() - started > timeout_s:
            return {"ok": ok, "seconds": time.perf_counter() - started, "stats": snaps}
        await asyncio.sleep(0.2)


# ---------------------------------------------------------------- workers

def worker_specs(model: str, kv_transport: str = "http") -> dict[str, list[str]]:
    """Name -> `edgeserve serve` flags (without --port; decode workers get --prefill-worker at start).
    KV pools are smaller than the default 512 MiB (each worker is ~2.5 GB with its MKL-packed weights,
    and the machine is shared); the largest need is ~1,500 tokens in flight, or the shared-prefix cache."""
    base = ["--model", model]
    fp8 = ["--kv-format", "fp8_e4m3", "--kv-cache-bytes", "128M"]  # 11,000 tokens
    return {
        "unified": base + ["--role", "unified", "--threads", "2", *fp8],
        "unified_cache": base + ["--role", "unified", "--threads", "2", *fp8, "--prefix-caching"],
        "prefill": base + ["--role", "prefill", "--threads", "1", "--kv-format", "fp32", "--kv-cache-bytes", "256M"],
        "decode": base + ["--role", "decode", "--threads", "1", *fp8, "--kv-wire", "fp8_e4m3",
                          "--kv-transport", kv_transport],
        "decode_bf16": base + ["--role", "decode", "--threads", "1", *fp8, "--kv-wire", "bf16"],
        **{name: base + flags for name, flags in TRANSPORT_WORKERS.items()},
    }


class Workers:
    """The worker subprocesses, started and stopped by phase (at most three at once: memory)."""

    def __init__(self, model: str, logs: Path, log: Callable[[str], None], kv_transport: str = "http") -> None:
        from ops.redis_server import free_port

        self.specs, self.logs, self.log = worker_specs(model, kv_transport), logs, log
        self.pids: dict[str, int] = {}
        self.urls = {name: f"http://127.0.0.1:{free_port()}" for name in self.specs}
        self.final_stats: dict[str, dict[str, Any]] = {}  # "name/n" (its n-th start) -> last /stats
        self._stacks: dict[str, contextlib.ExitStack] = {}
        self._starts: dict[str, int] = {}

    def start(self, *names: str) -> None:
        """Start `names` at once and wait for each `/health` (a worker that dies or hangs raises).
        Waits first (up to 5 minutes) for the memory they need: without swap, a machine short of
        memory does not fail but thrashes, and every figure would be wrong."""
        need = WORKER_GB * len(names) + 0.5
        deadline = time.perf_counter() + 300
        while mem_available_gb() < need:
            if time.perf_counter() > deadline:
                from backend.errors import CapacityError

                raise CapacityError(f"{mem_available_gb()} GB of memory available; {len(names)} workers need "
                                    f"~{need:.1f} GB (other processes hold the rest)")
            self.log(f"waiting for memory: {mem_available_gb()} GB available, {need:.1f} GB needed ...")
            time.sleep(15)
        self.log(f"starting {', '.join(names)} (logs in {self.logs}) ...")
        procs, started = {}, time.perf_counter()
        for name in names:
            self._starts[name] = self._starts.get(name, 0) + 1
            log_path = self.logs / f"{name}.{self._starts[name]}.log"
            prefill = "prefill_fp8" if name in TRANSPORT_WORKERS else "prefill"
            extra = ["--prefill-worker", self.urls[prefill]] if name.startswith("decode") else []
            argv = [sys.executable, "-m", "ops.cli", "serve", *self.specs[name], *extra,
                    "--port", self.urls[name].rsplit(":", 1)[1]]
            self._stacks[name] = contextlib.ExitStack()
            procs[name] = (self._stacks[name].enter_context(child_process(argv, log_path)), log_path)
            self.pids[name] = procs[name][0].pid
        for name, (proc, log_path) in procs.items():
            wait_http(f"{self.urls[name]}/health", proc, log_path, f"worker {name}", 300)
            self.log(f"worker {name} up at {self.urls[name]} ({time.perf_counter() - started:.0f} s)")

    def stop(self, *names: str) -> None:
        """Keep each worker's last `/stats`, then stop it."""
        import httpx

        for name in names:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                last = httpx.get(f"{self.urls[name]}/stats", timeout=5).json()
                self.final_stats[f"{name}/{self._starts[name]}"] = last
            self._stacks.pop(name).close()

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc: object) -> None:
        for stack in self._stacks.values():
            stack.close()
        self._stacks.clear()


def scan_logs(logs: Path) -> dict[str, dict[str, Any]]:
    """Per worker log: how many warning / error / traceback lines, and the first few."""
    out = {}
    for path in sorted(logs.glob("*.log")):
        bad = [line for line in path.read_text(errors="replace").splitlines()
               if '"level":"WARNING"' in line or '"level":"ERROR"' in line or "Traceback" in line]
        out[path.stem] = {"count": len(bad), "first": [line[:300] for line in bad[:5]]}
    return out


def load_now() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def mem_available_gb() -> float:
    with contextlib.suppress(OSError, StopIteration, ValueError):
        line = next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemAvailable"))
        return round(int(line.split()[1]) / 2**20, 1)
    return float("nan")


def uptime() -> str:
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        return subprocess.run(["uptime"], check=True, capture_output=True, text=True).stdout.strip()
    return ""


# ---------------------------------------------------------------- command

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
                   help="transport: requests per prompt length and transport (default 6; quick 2)")


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
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    started = time.perf_counter()
    machine = {**machine_info(), "uptime_start": uptime()}
    loads: dict[str, dict[str, Any]] = {}

    def mark(phase: str) -> None:
        loads[phase] = {"at_s": round(time.perf_counter() - started, 1), "load_1_5_15": load_now(),
                        "mem_available_gb": mem_available_gb()}
        log(f"[{loads[phase]['at_s']:.0f} s] {phase}: load average {loads[phase]['load_1_5_15']}, "
            f"{loads[phase]['mem_available_gb']} GB memory available")

    mark("start")
    resolve_model(args.model)  # pulled once, with progress, before any worker starts
    logs = Path(tempfile.mkdtemp(prefix="edgeserve-bench-pd-"))
    gc.collect()
    gc.freeze()  # this process holds torch: a full collection would land in some request's latency

    phases = [x for x in args.phases.split(",") if x]
    unknown = set(phases) - set(PHASES)
    if unknown:
        raise SystemExit(f"bench pd: unknown phases {sorted(unknown)}; choose from {','.join(PHASES)}")
    transport = {"lengths": (256, 1024), "requests": args.transport_requests or (2 if quick else 6)}
    result: dict[str, Any] = {}
    with Workers(args.model, logs, log, args.kv_transport) as workers:
        urls = workers.urls
        if "mixed" in phases:
            workers.start("unified", "prefill", "decode")
            mark("mixed_workers_up")
            result.update(asyncio.run(_mixed(urls, mixed, pairs, mark, log)))
            mark("after_mixed")
            workers.stop("unified", "prefill", "decode")
        if "wire" in phases:
            workers.start("prefill", "decode", "decode_bf16")
            result["wire"] = asyncio.run(_wire(urls, wire, args.seed, log))
            mark("after_wire")
            workers.stop("prefill", "decode", "decode_bf16")
        if "prefix" in phases:
            workers.start("unified", "unified_cache")
            mark("prefix_workers_up")
            result["prefix"] = asyncio.run(_prefix(urls, prefix, args.seed, log))
            workers.stop("unified", "unified_cache")
        if "transport" in phases:
            workers.start(*TRANSPORT_WORKERS)
            mark("transport_workers_up")
            result["transport"] = asyncio.run(transport_phase(urls, workers.pids, transport["lengths"],
                                                              transport["requests"], args.seed, log))
            mark("after_transport")
            workers.stop(*TRANSPORT_WORKERS)
    if "store" in phases:
        from ops.bench_pd_store import store_ttft
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

    report = _report(args, quick, machine, loads, mixed, pairs, prefix, wire | {}, result, problems, total_s)
    report["settings"]["transport"] = transport
    _print_tables(report)
    path = write_report(args.json_path, report)
    png = path.with_suffix(".png")
    if _plot(result, png):
        print(f"wrote {png}")
    if any(p["count"] for p in problems.values()):
        print(f"worker logs kept in {logs}")
    else:
        for f in logs.glob("*.log"):
            f.unlink()
        logs.rmdir()
    return 0


async def _warm_up(urls: list[str], long_prompt: int, seed: int, log: Callable[[str], None]) -> None:
    """A short and a long request through each entry point (first-request costs out of the figures)."""
    rng = random.Random(seed)
    warm = [closed_loop(u, [random_ids(rng, 64), random_ids(rng, long_prompt)], 4, 2, "warmup", f"warm-{i}")
            for i, u in enumerate(urls)]
    for recs in await asyncio.gather(*warm):
        for r in recs:
            if not r.ok:
                log(f"warning: warm-up request failed: {r.error}")


async def _mixed(urls: dict[str, str], mixed: MixedSettings, pairs: int, mark: Callable[[str], None],
                 log: Callable[[str], None]) -> dict[str, Any]:
    entry = {"unified": urls["unified"], "disaggregated": urls["decode"]}
    members = {"unified": [urls["unified"]], "disaggregated": [urls["decode"], urls["prefill"]]}
    await _warm_up(list(entry.values()), mixed.long_prompt, 1, log)
    idle = {"after_warmup": _idle_summary(await wait_idle([urls["unified"], urls["decode"], urls["prefill"]]))}
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
               "idle_after": _idle_summary(done), "load": load_now(), "requests": compact(records, start),
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


async def _wire(urls: dict[str, str], wire: dict[str, Any], seed: int, log: Callable[[str], None]) -> dict[str, Any]:
    await _warm_up([urls["decode_bf16"]], wire["prompt_tokens"], 2, log)
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
                    "pool_bytes_per_token": after[url]["kv_bytes_per_token"], "idle_after": _idle_summary(idle)}
        log(f"wire {fmt:<9}: {d['bytes_per_token']:.1f} B/token on the decode side, {p['bytes_per_token']:.1f} "
            f"sent by the prefill worker, {d['transfers']} transfers, {d['failed']} failed")
    return out


async def _prefix(urls: dict[str, str], prefix: dict[str, Any], seed: int,
                  log: Callable[[str], None]) -> dict[str, Any]:
    await _warm_up([urls["unified"], urls["unified_cache"]], prefix["prefix_tokens"], 3, log)
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
            "prefix_cache_after": pc_after, "idle_after": _idle_summary(idle), "records": records}
        log(f"shared prefix {name:<16}: TTFT p50 {st['ttft_p50_s']:.3f} s p95 {st['ttft_p95_s']:.3f} s, "
            f"{st['requests']} req in {seconds:.0f} s, hit rate {out[name]['hit_rate']}, errors {st['errors']}")
    return out


def _idle_summary(idle: dict[str, Any]) -> dict[str, Any]:
    keys = ("running", "waiting", "held", "pages_used", "pages_free", "pages_total")
    return {"ok": idle["ok"], "seconds": round(idle["seconds"], 2),
            "workers": {u: {k: s.get(k) for k in keys} | {"cached_blocks": (s.get("prefix_cache") or {}).get("blocks")}
                        for u, s in idle["stats"].items()}}


def _pooled(rounds: list[dict[str, Any]], config: str) -> dict[str, Any]:
    mine = [r for r in rounds if r["config"] == config]
    windows = [(r["records"], r["start"], r["end"]) for r in mine]
    return {"short": latency_stats("short", *windows), "long": latency_stats("long", *windows),
            "output_tok_s": sum(r["output_tok_s"] for r in mine) / len(mine), "rounds": len(mine),
            "per_round_short_tpot_p95_s": [r["short"]["tpot_p95_s"] for r in mine],
            "per_round_short_ttft_p50_s": [r["short"]["ttft_p50_s"] for r in mine],
            "per_round_output_tok_s": [r["output_tok_s"] for r in mine],
            "idle_after_every_round": all(r["idle_after"]["ok"] for r in mine)}


def _report(args, quick, machine, loads, mixed, pairs, prefix, wire, result, problems, total_s) -> dict[str, Any]:
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
        out["targets"]["transport"] = check("KV transfer ms at 1024 tokens http / mooncake",
                                            tr["transfer_ratio_http_over_mooncake"].get(1024, float("nan")), ">=", 2.0)
        out |= {"transfer_ms": tr["transfer_ms"], "transport": tr}
    if "store" in result:
        st = result["store"]
        out["ttft_p50_s"] |= {"store_hit": st["store_hit_p50_s"], "store_miss": st["store_miss_p50_s"]}
        out["targets"]["store"] = check("TTFT p50 store hit / recompute", ratio(st["store_hit_p50_s"],
                                                                                st["store_miss_p50_s"]), "<=", 0.5)
        out["store"] = st
    out |= {"final_worker_stats": result["final_stats"], "worker_log_problems": problems, "total_s": total_s}
    return out


def _print_tables(r: dict[str, Any]) -> None:
    ms = lambda v: f"{1e3 * v:.0f}"  # noqa: E731
    verdict = lambda t: f"{t['name']} = {t['value']:.3f} (target {t['rule']} {t['threshold']:g}): " + (  # noqa: E731
        "MET" if t["met"] else "MISSED")
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


def _plot(result: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no PNG", file=sys.stderr)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig.suptitle("bench pd: interference (left), prefix cache (right)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
