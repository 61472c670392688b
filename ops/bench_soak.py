"""Soak: a local cluster under mixed tenant traffic while workers, a prefill transfer and Redis are killed.

    edgeserve bench soak [--quick] [--minutes N] [--json PATH]

The cluster, all on this machine, every process with one ``EDGESERVE_WORKER_TOKEN``:
Redis (persistent: append-only file, fsync on every write, so a restart keeps
tenants and usage), a unified worker, a prefill worker and a decode worker paired
with it (SmolLM2-135M, ``--threads 1 --gemm-buckets none --kv-cache-bytes 64M``,
prefix caching on the unified and prefill workers), and two gateways routing over
the Redis registry.

Traffic (`ops.soak_traffic`), spread over both gateways and both APIs, half
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
(`ops.soak_checks`, which defines every count): no 5xx but typed 503s during faults,
metered == sent per tenant, metered completion tokens >= delivered, no leaked page,
no worker busy, no request past its timeout, every fault recovered. The exit status
is 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import random
import secrets
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ops.bench.report import provenance, write_report
from ops.cluster import Service, machine_info, wait_http, wait_redis
from ops.soak_checks import Fault, RequestResult, TenantMetering, build_report, missing_ids
from ops.soak_traffic import MODEL, Tenant, malformed_specs, send, send_cut_body, traffic_spec, worker_generate

__all__ = ["add_arguments", "run", "Settings", "Cluster", "fault_schedule"]

WORKER_FLAGS = ["--model", MODEL, "--threads", "1", "--gemm-buckets", "none", "--kv-cache-bytes", "64M"]
# name -> (requests per minute, tokens per day, clients, leaves non-streamed requests)
TENANTS: dict[str, tuple[int | None, int | None, int, bool]] = {
    "steady": (None, None, 2, False),
    "leaver": (None, None, 1, True),
    "rpm-limited": (6, None, 1, False),
    "token-limited": (None, 1500, 1, False),
    "malformed": (None, None, 0, False),
    "probe": (None, None, 0, False),
}
FAULT_KINDS = ("worker_kill", "redis_restart", "prefill_kill_mid_transfer")


@dataclass
class Settings:
    duration_s: float
    request_timeout_s: float = 90.0
    redis_outage_s: float = 4.0
    malformed_interval_s: float = 1.0
    grace_s: float = 5.0  # a fault's window lasts this long past its recovery
    recovery_cap_s: float = 180.0
    settle_cap_s: float = 60.0
    seed: int = 0


def fault_schedule(duration_s: float) -> list[tuple[float, str]]:
    """(seconds into the run, kind): the three kinds in turn, a round per ~150 s (at least one),
    spread evenly with no fault in the first or last stretch."""
    rounds = max(1, int(duration_s // 150))
    n = rounds * len(FAULT_KINDS)
    return [(duration_s * (i + 1) / (n + 1), FAULT_KINDS[i % len(FAULT_KINDS)]) for i in range(n)]


# ---------------------------------------------------------------- the cluster

class Cluster:
    """Redis, the three workers and two gateways, as restartable `Service`s."""

    def __init__(self, logs: Path, token: str) -> None:
        from ops.pull import resolve_model
        from ops.redis_server import free_port, redis_server_binary

        self.logs, self.token = logs, token
        self.env = {"EDGESERVE_WORKER_TOKEN": token}
        self.auth = {"authorization": f"Bearer {token}"}
        port = free_port()
        self.redis_url = f"redis://127.0.0.1:{port}/0"
        (logs / "redis").mkdir()
        self.redis = Service("redis-server", [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1",
                                              "--dir", str(logs / "redis"), "--save", "", "--appendonly", "yes",
                                              "--appendfsync", "always", "--loglevel", "warning"], logs / "redis.log")
        self.worker_urls = {name: f"http://127.0.0.1:{free_port()}" for name in ("unified", "prefill", "decode")}
        roles = {"unified": ["--role", "unified", "--prefix-caching"], "prefill": ["--role", "prefill",
                                                                                   "--prefix-caching"],
                 "decode": ["--role", "decode", "--prefill-worker", self.worker_urls["prefill"]]}
        self.workers = {name: Service(f"worker {name}", [
            sys.executable, "-m", "ops.cli", "serve", *WORKER_FLAGS, *roles[name], "--redis-url", self.redis_url,
            "--worker-id", name, "--port", url.rsplit(":", 1)[1]], logs / f"{name}.log", self.env)
            for name, url in self.worker_urls.items()}
        self.gateway_urls = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
        # the gateways' usage journals go to this run's own home (given the model folder, they pull nothing)
        home = {**self.env, "EDGESERVE_HOME": str(logs / "home")}
        self.gateways = [Service(f"gateway {i + 1}", [
            sys.executable, "-m", "ops.cli", "gateway", "--model", str(resolve_model(MODEL)), "--served-name", MODEL,
            "--redis-url", self.redis_url, "--port", url.rsplit(":", 1)[1]], logs / f"gateway{i + 1}.log", home)
            for i, url in enumerate(self.gateway_urls)]

    @property
    def services(self) -> list[Service]:
        return [self.redis, *self.workers.values(), *self.gateways]

    def start(self, log: Callable[[str], None]) -> None:
        """Start everything and wait until each answers (Redis first: the others register in it)."""
        started = time.perf_counter()
        self.start_redis()
        for svc in [*self.workers.values(), *self.gateways]:
            svc.start()
        for name, svc in self.workers.items():
            wait_http(f"{self.worker_urls[name]}/health", svc.proc, svc.log_path, svc.name, 300, self.auth)
        for url, svc in zip(self.gateway_urls, self.gateways):
            wait_http(f"{url}/healthz", svc.proc, svc.log_path, svc.name, 120)
        self.wait_registered(list(self.workers))
        log(f"cluster up in {time.perf_counter() - started:.0f} s (logs in {self.logs})")

    def start_redis(self) -> None:
        self.redis.start()
        wait_redis(self.redis_url, self.redis.proc, self.redis.log_path)

    def wait_registered(self, names: list[str], timeout_s: float = 30.0) -> None:
        import redis

        from backend.errors import BackendUnavailable
        from backend.registration import record_key

        client = redis.Redis.from_url(self.redis_url, socket_timeout=2)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if all(client.exists(record_key(MODEL, n)) for n in names):
                    return
                time.sleep(0.2)
        finally:
            client.close()
        raise BackendUnavailable(f"workers {names} did not all register in {timeout_s:.0f} s")

    def check_alive(self) -> None:
        for svc in self.services:
            svc.check_alive()

    def stop(self) -> None:
        for svc in [*self.gateways, *self.workers.values(), self.redis]:
            svc.stop()


async def create_tenants(redis_url: str) -> dict[str, Tenant]:
    """The soak's tenants with their limits, one API key each."""
    import redis.asyncio as aioredis

    from gateway.tenants import TenantStore

    client = aioredis.Redis.from_url(redis_url)
    try:
        store, out = TenantStore(client), {}
        for name, (rpm, tpd, _, leaves) in TENANTS.items():
            t = await store.create_tenant(f"soak-{name}", requests_per_minute=rpm, tokens_per_day=tpd)
            out[name] = Tenant(name, t.id, (await store.create_key(t.id)).token, leaves)
        return out
    finally:
        await client.aclose()


# ---------------------------------------------------------------- the run

class Soak:
    """One run: clients, the malformed stream and the fault scheduler on one event loop."""

    def __init__(self, cluster: Cluster, tenants: dict[str, Tenant], settings: Settings,
                 log: Callable[[str], None]) -> None:
        self.cluster, self.tenants, self.s, self.log = cluster, tenants, settings, log
        self.results: list[RequestResult] = []
        self.faults: list[Fault] = []
        self.t0 = time.perf_counter()
        self.rng = random.Random(settings.seed)
        self._probe_ids = itertools.count()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def run(self) -> None:
        import httpx

        self.t0 = time.perf_counter()
        deadline = self.s.duration_s
        async with httpx.AsyncClient(timeout=httpx.Timeout(self.s.request_timeout_s)) as client:
            self.client = client
            users = [self._user(self.tenants[name], i) for name, (_, _, n, _) in TENANTS.items() for i in range(n)]
            tasks = [asyncio.create_task(u) for u in users]
            tasks.append(asyncio.create_task(self._malformed(deadline)))
            await self._faults(deadline)
            await asyncio.gather(*tasks)
        self.log(f"[{self.now():.0f} s] load stopped; {len(self.results)} requests")

    async def _user(self, tenant: Tenant, index: int) -> None:
        import httpx

        rng = random.Random(f"{self.s.seed}-{tenant.name}-{index}")
        system = f"You are a helpful assistant for {tenant.name}. Answer briefly."
        async with httpx.AsyncClient(timeout=httpx.Timeout(self.s.request_timeout_s)) as client:
            for k in itertools.count():
                if self.now() >= self.s.duration_s:
                    return
                gateway = self.cluster.gateway_urls[(k + index) % len(self.cluster.gateway_urls)]
                res = await send(client, traffic_spec(rng, tenant, gateway, system), self.t0,
                                 self.s.request_timeout_s)
                self.results.append(res)
                # a polite client: after a refusal or a 503 it waits a moment (Retry-After, at most 2 s)
                pause = 0.0 if res.status in (None, 200) else 1.0
                await asyncio.sleep(pause + rng.uniform(0.0, 0.3))

    async def _malformed(self, deadline: float) -> None:
        t, other = self.tenants["malformed"], self.tenants["steady"]
        specs = [s for g in self.cluster.gateway_urls for s in malformed_specs(t, other, g)]
        count = 0
        for k in itertools.count():
            if self.now() >= deadline:
                break
            if k % (len(specs) // 2 + 1) == 0:
                gateway = self.cluster.gateway_urls[k % len(self.cluster.gateway_urls)]
                self.results.append(await send_cut_body(gateway, t.token, self.t0, t.name))
            else:
                self.results.append(await send(self.client, specs[k % len(specs)], self.t0, self.s.request_timeout_s))
            count += 1
            await asyncio.sleep(self.s.malformed_interval_s)
        self.faults.append(Fault("malformed_requests", 0.0, None, {"count": count, "kinds": len(specs) // 2 + 1}))

    # -- faults --------------------------------------------------------------------
    async def _faults(self, deadline: float) -> None:
        """Each fault at its time, whether or not the one before has recovered (a restarting worker
        may still be loading when Redis goes down: paths fail independently in production too)."""
        async def one(at: float, kind: str) -> None:
            await asyncio.sleep(max(0.0, at - self.now()))
            fault = await {"worker_kill": self._worker_kill, "redis_restart": self._redis_restart,
                           "prefill_kill_mid_transfer": self._prefill_kill}[kind]()
            self.faults.append(fault)
            rec = "NOT RECOVERED" if fault.recovery_s is None else f"recovered in {fault.recovery_s:.1f} s"
            self.log(f"[{fault.at_s:.0f} s] fault {kind}: {rec} {str(fault.detail)[:300]}")

        await asyncio.gather(*(one(at, kind) for at, kind in fault_schedule(deadline)))

    async def _worker_kill(self) -> Fault:
        svc = self.cluster.workers["unified"]
        svc.kill()
        fault = Fault("worker_kill", self.now(), detail={"worker": "unified", "signal": "SIGKILL"})
        svc.start()
        fault.recovered_at_s = await self._probe_worker("unified", fault)
        return fault

    async def _prefill_kill(self) -> Fault:
        decode, prefill = self.cluster.worker_urls["decode"], self.cluster.worker_urls["prefill"]
        prompt = [random.Random(f"victim-{len(self.faults)}").randrange(100, 40000) for _ in range(480)]
        victim = asyncio.create_task(worker_generate(self.client, decode, prompt, 4, f"soak-victim-{len(self.faults)}",
                                                     self.cluster.auth))
        phase = await self._wait_transfer(prefill, victim)
        self.cluster.workers["prefill"].kill()
        fault = Fault("prefill_kill_mid_transfer", self.now(), detail={"phase_seen": phase})
        try:
            last = await asyncio.wait_for(victim, 60)
        except Exception as exc:  # noqa: BLE001 - what the victim saw is the finding
            last = {"event": "client_error", "error": repr(exc)[:200]}
        fault.detail["victim_last_event"] = last
        self.cluster.workers["prefill"].start()
        fault.recovered_at_s = await self._probe_worker("decode", fault)
        return fault

    async def _wait_transfer(self, prefill: str, victim: asyncio.Task) -> str:
        """Poll the prefill worker until the victim's KV is held for shipping ("held"); if the victim's
        prefill is seen running but never held within 20 s, or ends, settle for what was seen."""
        seen = "none"
        deadline = time.perf_counter() + 20
        while time.perf_counter() < deadline and not victim.done():
            with contextlib.suppress(Exception):
                snap = (await self.client.get(f"{prefill}/stats", headers=self.cluster.auth, timeout=2)).json()
                if snap.get("held", 0) > 0:
                    return "held (pages being shipped)"
                if snap.get("running", 0) > 0:
                    seen = "running (prompt being computed)"
            await asyncio.sleep(0.01)
        return seen if not victim.done() else f"{seen}; the victim ended first"

    async def _redis_restart(self) -> Fault:
        self.cluster.redis.kill()
        fault = Fault("redis_restart", self.now(), detail={"outage_s": self.s.redis_outage_s, "signal": "SIGKILL"})
        await asyncio.sleep(self.s.redis_outage_s)
        await asyncio.to_thread(self.cluster.start_redis)
        fault.detail["back_at_s"] = round(self.now(), 2)
        recovered = [await self._probe_gateway(g, fault) for g in self.cluster.gateway_urls]
        fault.recovered_at_s = None if None in recovered else max(recovered)
        return fault

    async def _probe_worker(self, name: str, fault: Fault) -> float | None:
        """Seconds into the run when a 2-token request straight to worker `name` first succeeds."""
        url, attempts = self.cluster.worker_urls[name], 0
        while self.now() - fault.at_s < self.s.recovery_cap_s:
            attempts += 1
            with contextlib.suppress(Exception):
                last = await worker_generate(self.client, url, list(range(100, 112)), 2,
                                             f"soak-probe-{next(self._probe_ids)}", self.cluster.auth)
                if last is not None and last.get("event") == "finish":
                    fault.detail["probe_attempts"] = attempts
                    return self.now()
            await asyncio.sleep(0.5)
        fault.detail["probe_attempts"] = attempts
        return None

    async def _probe_gateway(self, gateway: str, fault: Fault) -> float | None:
        """Seconds into the run when a probe tenant's request through `gateway` first succeeds (its
        requests count like any tenant's)."""
        probe = self.tenants["probe"]
        spec_rng = random.Random(f"probe-{gateway}-{fault.at_s}")
        while self.now() - fault.at_s < self.s.recovery_cap_s:
            spec = traffic_spec(spec_rng, probe, gateway, "Answer briefly.")
            res = await send(self.client, spec, self.t0, self.s.request_timeout_s)
            self.results.append(res)
            if res.outcome == "ok":
                return res.ended
            await asyncio.sleep(0.5)
        return None


# ---------------------------------------------------------------- ending: idle, settled, measured

async def wait_idle(cluster: Cluster, cap_s: float) -> dict[str, dict[str, Any]]:
    """Poll every worker's /stats until nothing runs, waits or is held and every page is back
    (cached blocks nobody reads count as free), or `cap_s` passes; the last snapshots."""
    import httpx

    from ops.soak_checks import leaked_pages

    deadline = time.perf_counter() + cap_s
    async with httpx.AsyncClient(timeout=5, headers=cluster.auth) as client:
        while True:
            snaps: dict[str, dict[str, Any]] = {}
            for name, url in cluster.worker_urls.items():
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    snaps[name] = (await client.get(f"{url}/stats")).json()
            idle = len(snaps) == len(cluster.worker_urls) and all(
                s["running"] == s["waiting"] == s.get("held", 0) == 0 and leaked_pages(s) == 0
                for s in snaps.values())
            if idle or time.perf_counter() > deadline:
                return snaps
            await asyncio.sleep(0.5)


def read_metering(redis_url: str, tenants: dict[str, Tenant], days: list[str]) -> dict[str, TenantMetering]:
    """Every tenant's usage counters summed over `days` (all models) and its usage events' request ids."""
    import redis

    from gateway import redis_keys as rk

    client = redis.Redis.from_url(redis_url, decode_responses=True, socket_timeout=5)
    try:
        out = {}
        for name, t in tenants.items():
            m = TenantMetering()
            for day in days:
                for field, value in client.hgetall(rk.usage(t.id, day)).items():
                    metric = field.rpartition("|")[2]
                    if metric == "requests":
                        m.requests += int(value)
                    elif metric == "completion_tokens":
                        m.completion_tokens += int(value)
            m.request_ids = {fields["request_id"] for _, fields in client.xrange(rk.usage_events(t.id))}
            out[name] = m
        return out
    finally:
        client.close()


def wait_settled(redis_url: str, tenants: dict[str, Tenant], days: list[str], cap_s: float,
                 quiet_s: float = 4.0) -> dict[str, TenantMetering]:
    """Read the metering until no counter has moved for `quiet_s` (gateways have replayed any
    journal), or `cap_s` passes."""
    deadline, last, since = time.perf_counter() + cap_s, None, time.perf_counter()
    while True:
        now = read_metering(redis_url, tenants, days)
        key = {n: (m.requests, m.completion_tokens, len(m.request_ids)) for n, m in now.items()}
        if key != last:
            last, since = key, time.perf_counter()
        elif time.perf_counter() - since >= quiet_s or time.perf_counter() > deadline:
            return now
        time.sleep(1.0)


def diagnose_missing(redis_url: str, tenants: dict[str, Tenant], missing: dict[str, set[str]]) -> dict[str, Any]:
    """For admitted requests without a usage event: is their idempotency marker set (settled as a
    release, or a record that was skipped) or absent (never reached Redis)?"""
    import redis

    from gateway import redis_keys as rk

    client = redis.Redis.from_url(redis_url, socket_timeout=5)
    try:
        return {name: {"marker_set": sorted(i for i in ids if client.exists(rk.metered(tenants[name].id, i))),
                       "no_marker": sorted(i for i in ids if not client.exists(rk.metered(tenants[name].id, i)))}
                for name, ids in missing.items() if ids and name in tenants}
    finally:
        client.close()


def scan_logs(logs: Path) -> dict[str, int]:
    """Per process log: lines that report a traceback or an ERROR (findings, not targets)."""
    return {p.stem: sum("Traceback" in line or "ERROR" in line for line in p.read_text(errors="replace").splitlines())
            for p in sorted(logs.glob("*.log"))}


# ---------------------------------------------------------------- command

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=None, help="minutes of load (default 10; quick 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep-logs", action="store_true", help="keep the processes' logs even when every target is met")


def run(args: argparse.Namespace) -> int:
    from gateway.redis_keys import utc_day
    from ops.pull import resolve_model

    settings = Settings(duration_s=60 * (args.minutes or (1.0 if args.quick else 10.0)), seed=args.seed,
                        redis_outage_s=4.0 if args.quick else 10.0)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
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
              **report, "missing_diagnosis": diagnosis, "processes_dead_at_end": alive, "log_error_lines": scan_logs(logs),
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
