"""`edgeserve bench routing`'s processes: four workers with prefix caching that register in Redis and a
gateway routing over them with one policy, started cold for every run; a memory check first (four
workers need ~13 GiB), warm-up requests, and the workers' own prefix-cache counters."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from ops.bench.harness.machine import mem_available_gib
from ops.bench.harness.procs import wait_registered
from ops.bench.routing.workload import MODEL
from ops.cluster import child_process, wait_http

__all__ = ["NUM_WORKERS", "WORKER_RSS_GIB", "Fleet", "check_memory", "start_fleet", "warm_up", "worker_stats",
           "worker_hits"]

NUM_WORKERS = 4
WORKER_RSS_GIB = 3.0  # one warmed-up worker's resident memory, measured here (SmolLM2-135M, 256M KV; was 2.8 idle)


def check_memory(allow: bool, log: Callable[[str], None]) -> None:
    """Refuse to start 4 workers without the memory they need (the kernel's OOM killer would pick a
    process, maybe someone else's), unless `allow`: then only warn."""
    free, need = mem_available_gib(), NUM_WORKERS * WORKER_RSS_GIB + 1
    if free < need:
        msg = (f"{free:.1f} GiB of memory available; 4 workers need about {need:.0f} GiB: the kernel could kill "
               f"a process mid-run")
        if not allow:
            raise SystemExit(f"edgeserve bench routing: {msg} (--allow-low-memory to run anyway)")
        log(f"warning: {msg}")


class Fleet(NamedTuple):
    gateway_url: str
    workers: dict[str, str]  # worker URL -> id
    procs: list[tuple[subprocess.Popen, Path, str]]  # (process, its log, what it is)

    def check_alive(self) -> None:
        """Raise, with the log's tail, if a worker or the gateway has exited (e.g. killed for memory)."""
        from backend.errors import BackendUnavailable

        for proc, path, what in self.procs:
            if proc.poll() is not None:
                tail = path.read_text(errors="replace")[-1500:]
                raise BackendUnavailable(f"{what} exited with status {proc.returncode} during the run (a negative "
                                         f"status is a signal: -9 is often the kernel's OOM killer); its log "
                                         f"ends:\n{tail}")


def start_fleet(stack: contextlib.ExitStack, redis_url: str, policy: str, kv_bytes: str, logs: Path,
                 log: Callable[[str], None], prefix: str = "", gateway_args: Sequence[str] = ()) -> Fleet:
    """Start 4 workers and a gateway with `policy` and `gateway_args` (stopped by `stack`)."""
    from ops.redis_server import free_port

    workers: dict[str, str] = {}
    worker_logs: dict[str, Path] = {}  # worker id -> its log
    procs = []
    for n in range(1, NUM_WORKERS + 1):
        wid, port = f"w{n}", free_port()
        workers[f"http://127.0.0.1:{port}"] = wid
        path = worker_logs[wid] = logs / f"{prefix}{policy}-{wid}.log"
        procs.append((stack.enter_context(child_process(
            [sys.executable, "-m", "ops.cli", "serve", "--model", MODEL, "--port", str(port), "--threads", "1",
             "--prefix-caching", "--redis-url", redis_url, "--worker-id", wid, "--kv-cache-bytes", kv_bytes], path)),
            f"http://127.0.0.1:{port}/health", path, f"worker {wid}"))
    gateway_port = free_port()
    path = logs / f"{prefix}{policy}-gateway.log"
    procs.append((stack.enter_context(child_process(
        [sys.executable, "-m", "ops.cli", "gateway", "--model", MODEL, "--redis-url", redis_url,
         "--port", str(gateway_port), "--policy", policy, *gateway_args], path)),
        f"http://127.0.0.1:{gateway_port}/healthz", path, "the gateway"))
    started = time.perf_counter()
    for proc, url, path, what in procs:
        wait_http(url, proc, path, what, 180)
    wait_registered(redis_url, MODEL, list(workers.values()), logs=worker_logs)
    log(f"  4 workers + gateway ({policy}) up in {time.perf_counter() - started:.0f} s")
    return Fleet(f"http://127.0.0.1:{gateway_port}", workers, [(proc, path, what) for proc, _, path, what in procs])


async def warm_up(worker_urls: list[str]) -> None:
    """One short request straight to each worker (no full block: nothing is cached or counted)."""
    import httpx

    async with httpx.AsyncClient(timeout=120) as client:
        for url in worker_urls:
            body = {"prompt_ids": list(range(100, 108)), "params": {"max_tokens": 4, "temperature": 0.0}}
            resp = await client.post(f"{url}/v1/generate", json=body)
            resp.raise_for_status()


async def worker_stats(worker_urls: list[str]) -> dict[str, dict[str, Any]]:
    """Every worker's `/stats`, by URL."""
    import httpx

    async with httpx.AsyncClient(timeout=30) as client:
        return {url: (await client.get(f"{url}/stats")).json() for url in worker_urls}


def worker_hits(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> tuple[int, int]:
    """Change in (hit_tokens, query_tokens) of the workers' prefix caches, summed over workers."""
    hit = sum(after[u]["prefix_cache"]["hit_tokens"] - before[u]["prefix_cache"]["hit_tokens"] for u in after)
    query = sum(after[u]["prefix_cache"]["query_tokens"] - before[u]["prefix_cache"]["query_tokens"] for u in after)
    return hit, query
