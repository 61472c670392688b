"""The soak's run on one event loop: every tenant's clients, the stream of malformed requests, and the
faults at their times (SIGKILL a worker, the prefill worker mid-transfer, Redis), each followed until
a probe request succeeds again."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from ops.bench.soak.checks import Fault, RequestResult
from ops.bench.soak.cluster import Cluster
from ops.bench.soak.traffic import (TENANTS, Tenant, malformed_specs, send, send_cut_body, traffic_spec,
                                    worker_generate)

__all__ = ["Settings", "Soak", "fault_schedule", "FAULT_KINDS"]

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
