"""`edgeserve bench pd`'s worker processes, by name (`worker_specs`): started and stopped by phase, at
most three at once (each holds ~2.7 GB), each after waiting for the memory it needs."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ops.bench.harness.machine import mem_available_gib
from ops.bench.pd.transport import TRANSPORT_WORKERS
from ops.cluster import child_process, wait_http

__all__ = ["WORKER_GB", "worker_specs", "Workers"]

WORKER_GB = 2.7  # resident size of one worker here: weights, their MKL-packed copies (3 buckets), the KV pool


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
        while mem_available_gib(1) < need:
            if time.perf_counter() > deadline:
                from backend.errors import CapacityError

                raise CapacityError(f"{mem_available_gib(1)} GB of memory available; {len(names)} workers need "
                                    f"~{need:.1f} GB (other processes hold the rest)")
            self.log(f"waiting for memory: {mem_available_gib(1)} GB available, {need:.1f} GB needed ...")
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
