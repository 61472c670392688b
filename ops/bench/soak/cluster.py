"""The soak's cluster: Redis (persistent, so a restart keeps tenants and usage), a unified, a prefill and
a decode worker, and two gateways routing over the Redis registry, all restartable `Service`s sharing
one worker token; and the soak's tenants with their limits."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

from ops.bench.harness.procs import wait_registered
from ops.bench.harness.tenants import create_tenants as new_tenants
from ops.bench.soak.traffic import MODEL, TENANTS, Tenant
from ops.cluster import Service, wait_http, wait_redis

__all__ = ["WORKER_FLAGS", "Cluster", "create_tenants"]

WORKER_FLAGS = ["--model", MODEL, "--threads", "1", "--gemm-buckets", "none", "--kv-cache-bytes", "64M"]


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
        wait_registered(self.redis_url, MODEL, names, timeout_s,
                        logs={n: self.workers[n].log_path for n in names if n in self.workers})

    def check_alive(self) -> None:
        for svc in self.services:
            svc.check_alive()

    def stop(self) -> None:
        for svc in [*self.gateways, *self.workers.values(), self.redis]:
            svc.stop()


async def create_tenants(redis_url: str) -> dict[str, Tenant]:
    """The soak's tenants with their limits, one API key each."""
    made = await new_tenants(redis_url, [(f"soak-{name}", {"requests_per_minute": rpm, "tokens_per_day": tpd})
                                         for name, (rpm, tpd, _, _) in TENANTS.items()])
    return {name: Tenant(name, t.id, t.token, leaves) for (name, (_, _, _, leaves)), t in zip(TENANTS.items(), made)}
