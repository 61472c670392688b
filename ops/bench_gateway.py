"""Gateway overhead: the edgeserve gateway and LiteLLM's proxy in front of the same instant worker.

Processes, all on this machine: Redis (`ops.redis_server`), a stand-in worker (no
model; `per_token_standin_app` below, a subprocess) that streams exactly as real
workers do: one NDJSON `TokenEvent` per token on the worker protocol, one SSE chunk
per token on its OpenAI endpoint, with no pause between tokens, so every per-token
cost of a path shows in its latency. Then the edgeserve gateway (`edgeserve
gateway`, a subprocess, as deployed) and LiteLLM's proxy (a subprocess from its
own venv under ~/.cache/edgeserve/bench-venvs/litellm, installed on first use;
skipped with ``--no-litellm`` or when it does not install). Targets, all OpenAI
``POST /v1/chat/completions`` for the same N tokens:

- ``direct``: the stand-in itself (the floor: load generator + HTTP + stand-in);
- ``worker``: the stand-in's worker protocol (``/v1/generate``, the gateway's request
  to it: the chat template's prompt ids, N tokens, one NDJSON line per token), read
  whole; non-stream settings only. Not a target for the added latency: it shows what
  the worker's per-token stream costs by itself, which the gateway path pays and
  ``direct`` does not;
- ``edgeserve``: the gateway with a tenant without quotas: each request still
  authenticates, is tokenised, routed, detokenised and metered in Redis;
- ``edgeserve+quota``: the same gateway with a tenant that has both quotas
  (requests per minute and tokens per day, set far above what the run uses), so
  each request also passes quota admission and settles its reservation;
- ``litellm``: the proxy with model ``openai/smollm2-135m`` at the stand-in and
  a static ``master_key`` (no database: that is how LiteLLM runs without
  Postgres, and it leaves out its virtual keys, spend tracking and rate limits).
  Otherwise its defaults (one process, uvicorn; `LITELLM_LOCAL_MODEL_COST_MAP`
  is set only so start-up does not fetch the cost map from the network);
- with ``--baseline REF``: ``edgeserve@REF`` and ``edgeserve+quota@REF``, a second
  gateway run from ``git archive REF`` (same Redis, stand-in and requests), so a
  change is measured against the code before it in the same run.

Load: closed loop in this process: c users, each with its own httpx.AsyncClient
(one keep-alive connection), send requests back to back for a round of D seconds
(after a short unmeasured warm-up round that reopens connections). Rounds are
interleaved: every repetition visits every setting (c x stream) and within it
every target, the order rotating, so a burst of machine noise lands on all
targets rather than one. Latency: non-stream, the full response; stream, the last
byte (TTFT: the first body bytes). Percentiles are nearest-rank over all rounds'
requests; requests/s = requests / seconds of all rounds. Added latency = target
p50 (p95, p99) minus direct's at the same setting; both pay the load generator
and the stand-in, so the difference is what the proxy adds (its work and one more
loopback hop). The load generator's own garbage collector runs only between
rounds. CPU ms/request: CPU time of the proxy process (and of Redis, for
edgeserve) over its measured rounds / requests.

This machine has few cores (often 2): the load generator, the stand-in, the proxy
and Redis share them. Each proxy is one process (one core at most), so once c is
high enough to keep it busy its requests/s is about 1 / its CPU per request, and
CPU ms/request is the steadier measure of a proxy's cost than latency.

JSON: ``added_latency_ms`` maps target -> setting ("c1_nostream", "c1_stream", ...)
-> {"p50", "p95", "p99"}; ``headline`` holds edgeserve+quota at c=1, both ways,
against the 2 ms target; ``rps`` maps target -> setting -> requests/s (litellm
null when unavailable); ``added_latency_p50_ms`` / ``_p99_ms`` keep the older
keys for the tenant without quotas.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import gc
import itertools
import os
import secrets
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec

from ops.bench.report import write_report
from ops.bench.harness.stats import percentile
from ops.cluster import child_process, machine_info, wait_http

if TYPE_CHECKING:
    import httpx
    from starlette.applications import Starlette
    from starlette.requests import Request

__all__ = ["add_arguments", "run", "Row", "compare", "setting_key", "per_token_standin_app", "TARGETS"]

TARGETS = ("direct", "worker", "edgeserve", "edgeserve+quota", "litellm")  # table order; baselines follow their own
MODEL = "smollm2-135m"
LITELLM_VENV = Path.home() / ".cache" / "edgeserve" / "bench-venvs" / "litellm"


def setting_key(concurrency: int, stream: bool) -> str:
    return f"c{concurrency}_{'stream' if stream else 'nostream'}"


@dataclass
class Row:
    """One target at one setting, over all its measured rounds."""

    target: str
    concurrency: int
    stream: bool
    requests: int
    errors: int
    seconds: float
    rps: float
    p50_ms: float
    p99_ms: float
    p95_ms: float | None = None
    ttft_p50_ms: float | None = None  # stream only
    ttft_p99_ms: float | None = None
    proxy_cpu_ms_per_request: float | None = None  # None for direct
    redis_cpu_ms_per_request: float | None = None  # edgeserve only
    p50_rounds_ms: list[float] = field(default_factory=list)
    rps_rounds: list[float] = field(default_factory=list)
    error_kinds: dict[str, int] = field(default_factory=dict)  # errors by kind ("HTTP 503", "stream cut", ...)

    @property
    def key(self) -> str:
        return setting_key(self.concurrency, self.stream)


def compare(rows: list[Row]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per target and setting: latency added over direct (ms) and requests/s relative to litellm.

    `added_p50_ms` = target p50 - direct p50 (positive: the proxy costs time); likewise p95, p99;
    `added_p50_rounds_ms` is the same difference round by round (rounds of a setting run side by
    side), as (min, max). `rps_ratio_vs_litellm` = target rps / litellm rps (> 1: faster than
    LiteLLM). Entries are None where the other row is missing.
    """
    by = {(r.target, r.key): r for r in rows}
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        direct, litellm = by.get(("direct", r.key)), by.get(("litellm", r.key))
        entry: dict[str, Any] = {"added_p50_ms": None, "added_p95_ms": None, "added_p99_ms": None,
                                 "added_p50_rounds_ms": None, "rps_ratio_vs_litellm": None}
        if direct is not None and r.target != "direct":
            entry["added_p50_ms"] = r.p50_ms - direct.p50_ms
            entry["added_p99_ms"] = r.p99_ms - direct.p99_ms
            if r.p95_ms is not None and direct.p95_ms is not None:
                entry["added_p95_ms"] = r.p95_ms - direct.p95_ms
            paired = [a - b for a, b in zip(r.p50_rounds_ms, direct.p50_rounds_ms)]
            entry["added_p50_rounds_ms"] = (min(paired), max(paired)) if paired else None
        if litellm is not None and litellm.rps > 0:
            entry["rps_ratio_vs_litellm"] = r.rps / litellm.rps
        out.setdefault(r.target, {})[r.key] = entry
    return out


# ---------------------------------------------------------------- per-token stand-in worker

class _ChatFields(msgspec.Struct):
    """What the per-token chat endpoint reads of an OpenAI request (other fields are ignored)."""

    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None


def per_token_standin_app(num_tokens: int) -> Starlette:
    """`ops.standin_worker`'s stand-in, streaming as real workers do: one NDJSON `TokenEvent` per token
    on /v1/generate (`backend/worker.py` writes one line per engine step), and one SSE chunk per
    token on /v1/chat/completions (what the gateway sends its clients). No pause between tokens:
    every per-token cost of the path lands in the latency. Other routes are the stand-in's."""
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    from backend.protocol import FinishEvent, GenerateRequest, TokenEvent, encoder
    from ops.standin_worker import HELLO_WORLD, create_standin_app

    app = create_standin_app(num_tokens)
    generate_decoder, chat_decoder = msgspec.json.Decoder(GenerateRequest), msgspec.json.Decoder(_ChatFields)

    texts = list(itertools.islice(itertools.cycle(HELLO_WORLD), num_tokens))  # (id, text) per token

    async def generate(request: Request) -> Response:
        req = generate_decoder.decode(await request.body())
        arrived, n = time.perf_counter(), min(num_tokens, req.params.max_tokens)

        async def body() -> AsyncIterator[bytes]:
            for token_id, _ in texts[:n]:
                yield encoder.encode(TokenEvent([token_id], [time.perf_counter() - arrived])) + b"\n"
            elapsed = time.perf_counter() - arrived
            yield encoder.encode(FinishEvent("length", len(req.prompt_ids), n, ttft_s=elapsed,
                                             total_s=elapsed)) + b"\n"

        return StreamingResponse(body(), media_type="application/x-ndjson")

    async def chat(request: Request) -> Response:
        req = chat_decoder.decode(await request.body())
        n = min(num_tokens, req.max_completion_tokens or req.max_tokens or num_tokens)
        usage = {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}
        head = {"id": "chatcmpl-standin", "created": int(time.time()), "model": MODEL}
        if not req.stream:
            return Response(msgspec.json.encode({**head, "object": "chat.completion", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "".join(t for _, t in texts[:n])},
                 "finish_reason": "length", "logprobs": None}], "usage": usage}), media_type="application/json")

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
            return b"data: " + msgspec.json.encode({**head, "object": "chat.completion.chunk", "choices": choices,
                                                    **extra}) + b"\n\n"

        async def body() -> AsyncIterator[bytes]:
            for k, (_, text) in enumerate(texts[:n]):
                delta = {"role": "assistant", "content": text} if k == 0 else {"content": text}
                yield chunk([{"index": 0, "delta": delta, "finish_reason": None, "logprobs": None}])
            yield chunk([{"index": 0, "delta": {}, "finish_reason": "length", "logprobs": None}])
            if (req.stream_options or {}).get("include_usage"):
                yield chunk([], usage=usage)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream", headers={"cache-control": "no-cache"})

    app.router.routes[:0] = [Route("/v1/generate", generate, methods=["POST"]),
                             Route("/v1/chat/completions", chat, methods=["POST"])]
    return app


# ---------------------------------------------------------------- load generator

class Target(NamedTuple):
    name: str
    url: str  # the chat completions URL (`worker`: the stand-in's /v1/generate)
    headers: dict[str, str]
    pid: int | None  # the proxy's process (CPU accounting); None for direct
    body: bytes | None = None  # the request, when not the chat request (`worker`: its GenerateRequest)


class RoundResult(NamedTuple):
    latencies: list[float]  # seconds, full response (stream: last byte)
    ttfts: list[float]  # seconds to the first body bytes (stream only)
    errors: collections.Counter[str]  # failed requests by kind ("HTTP 503", "stream cut", an exception's name)
    seconds: float


def request_body(num_tokens: int, stream: bool) -> bytes:
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello to the world."}],
                            "max_tokens": num_tokens, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return msgspec.json.encode(body)


def worker_body(num_tokens: int) -> bytes:
    """The chat request as the gateway sends it on: its prompt ids (the model's chat template), N tokens."""
    from backend.protocol import GenerateRequest
    from backend.sampling_params import SamplingParams
    from backend.tokenizer import Tokenizer
    from ops.pull import resolve_model

    messages = msgspec.json.decode(request_body(num_tokens, False))["messages"]
    prompt_ids = Tokenizer.from_model_dir(resolve_model(MODEL, progress=False)).encode_chat(messages)
    return msgspec.json.encode(GenerateRequest(prompt_ids, SamplingParams(max_tokens=num_tokens), model=MODEL))


async def _one(client: httpx.AsyncClient, target: Target, body: bytes,
               stream: bool) -> tuple[float, float | None, str | None]:
    """(latency, ttft, what went wrong: None, "HTTP <status>" or "stream cut" when no [DONE] came)."""
    t0 = time.perf_counter()
    if not stream:
        resp = await client.post(target.url, content=body, headers=target.headers)
        return time.perf_counter() - t0, None, None if resp.status_code == 200 else f"HTTP {resp.status_code}"
    first, tail = None, b""
    async with client.stream("POST", target.url, content=body, headers=target.headers) as resp:
        async for chunk in resp.aiter_raw():
            if first is None:
                first = time.perf_counter() - t0
            tail = (tail + chunk)[-16:]
    problem = None if resp.status_code == 200 else f"HTTP {resp.status_code}"
    if problem is None and not tail.endswith(b"data: [DONE]\n\n"):
        problem = "stream cut"
    return time.perf_counter() - t0, first, problem


async def run_round(clients: list[httpx.AsyncClient], target: Target, concurrency: int, stream: bool,
                    body: bytes, duration_s: float) -> RoundResult:
    """`concurrency` users (each its own client) sending back to back until `duration_s`; every reply awaited."""
    latencies: list[float] = []
    ttfts: list[float] = []
    errors: collections.Counter[str] = collections.Counter()
    start = time.perf_counter()
    deadline = start + duration_s

    async def loop(client: httpx.AsyncClient) -> None:
        while time.perf_counter() < deadline:
            try:
                latency, ttft, problem = await _one(client, target, body, stream)
            except Exception as exc:  # noqa: BLE001 - counted; a dead target must not spin
                errors[type(exc).__name__] += 1
                await asyncio.sleep(0.01)
                continue
            if problem is not None:
                errors[problem] += 1
                continue
            latencies.append(latency)
            if ttft is not None:
                ttfts.append(ttft)

    await asyncio.gather(*(loop(client) for client in clients[:concurrency]))
    return RoundResult(latencies, ttfts, errors, time.perf_counter() - start)


async def expected_text_check(client: httpx.AsyncClient, target: Target, num_tokens: int,
                              expected: str) -> str | None:
    """None when the target answers with the stand-in's text, else what went wrong."""
    resp = await client.post(target.url, content=request_body(num_tokens, False), headers=target.headers)
    if resp.status_code != 200:
        return f"HTTP {resp.status_code}: {resp.text[:200]}"
    content = resp.json()["choices"][0]["message"]["content"]
    return None if content == expected else f"content {content[:80]!r} != expected {expected[:80]!r}"


def _cpu_s(pids: list[int]) -> float:
    """utime + stime of these processes (seconds)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    return total / ticks


def _descendants(pid: int) -> list[int]:
    """`pid` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def _redis_pids() -> list[int]:
    return [p for p in _descendants(os.getpid())
            if Path(f"/proc/{p}/comm").exists() and Path(f"/proc/{p}/comm").read_text().strip() == "redis-server"]


@dataclass
class _Samples:
    """What one target's measured rounds at one setting collected."""

    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    seconds: float = 0.0
    proxy_cpu_s: float = 0.0
    redis_cpu_s: float = 0.0
    p50_rounds_ms: list[float] = field(default_factory=list)
    rps_rounds: list[float] = field(default_factory=list)

    def add(self, res: RoundResult, proxy_cpu_s: float, redis_cpu_s: float) -> None:
        self.latencies += res.latencies
        self.ttfts += res.ttfts
        self.errors.update(res.errors)
        self.seconds += res.seconds
        self.proxy_cpu_s += proxy_cpu_s
        self.redis_cpu_s += redis_cpu_s
        self.p50_rounds_ms.append(1e3 * percentile(res.latencies, 0.5))
        self.rps_rounds.append(len(res.latencies) / res.seconds)

    def row(self, target: str, c: int, stream: bool, redis_counted: bool) -> Row:
        n, ms = len(self.latencies), lambda values, q: 1e3 * percentile(values, q)
        return Row(target=target, concurrency=c, stream=stream, requests=n, errors=sum(self.errors.values()),
                   error_kinds=dict(self.errors),
                   seconds=self.seconds, rps=n / self.seconds, p50_ms=ms(self.latencies, 0.5),
                   p99_ms=ms(self.latencies, 0.99), p95_ms=ms(self.latencies, 0.95),
                   ttft_p50_ms=ms(self.ttfts, 0.5) if stream else None,
                   ttft_p99_ms=ms(self.ttfts, 0.99) if stream else None,
                   proxy_cpu_ms_per_request=1e3 * self.proxy_cpu_s / n if target not in ("direct", "worker") and n
                   else None,
                   redis_cpu_ms_per_request=1e3 * self.redis_cpu_s / n if redis_counted and n else None,
                   p50_rounds_ms=self.p50_rounds_ms, rps_rounds=self.rps_rounds)


async def measure(targets: list[Target], points: list[int], streams: list[bool], num_tokens: int, rounds: int,
                  duration_s: float, warmup_s: float, log: Callable[[str], None]) -> list[Row]:
    """Every repetition visits every setting, and within it every target (order rotating); one Row each."""
    import httpx

    # One client (one keep-alive connection) per simulated user: a single AsyncClient shared by c tasks
    # queues them in httpcore's pool, which here halved direct's requests/s at c=16 and put a 10x tail on p99.
    tls = ssl.create_default_context()  # never used (plain http on loopback); made once instead of per client
    clients = {t.name: [httpx.AsyncClient(verify=tls, timeout=httpx.Timeout(60.0)) for _ in range(max(points))]
               for t in targets}
    redis_pids = _redis_pids()
    samples: dict[tuple[str, int, bool], _Samples] = {}
    # This process holds torch (the bench registry imports it): a full collection walks ~200k objects,
    # ~0.1 s, which would land in some target's latencies. Freeze what exists, collect only between rounds.
    gc.collect()
    gc.freeze()
    try:
        settings = [(c, stream) for c in points for stream in streams]
        for rep in range(rounds):
            for i, (c, stream) in enumerate(settings):
                turn = (rep + i) % len(targets)
                for target in targets[turn:] + targets[:turn]:
                    if target.body is not None and stream:
                        continue  # the worker protocol is one NDJSON stream: measured once, as non-stream
                    users, body = clients[target.name], target.body or request_body(num_tokens, stream)
                    await run_round(users, target, c, stream, body, warmup_s)
                    pids = _descendants(target.pid) if target.pid else []
                    gc.collect()
                    gc.disable()
                    cpu0, redis0 = _cpu_s(pids), _cpu_s(redis_pids)
                    res = await run_round(users, target, c, stream, body, duration_s)
                    cpu, redis = _cpu_s(pids) - cpu0, _cpu_s(redis_pids) - redis0
                    gc.enable()
                    samples.setdefault((target.name, c, stream), _Samples()).add(res, cpu, redis)
                    log(f"round {rep + 1}/{rounds} {setting_key(c, stream):<13} {target.name:<9} "
                        f"{len(res.latencies) / res.seconds:8.1f} req/s  "
                        f"p50 {1e3 * percentile(res.latencies, 0.5):7.2f} ms"
                        f"{f'  errors {dict(res.errors)}' if res.errors else ''}")
    finally:
        gc.enable()
        gc.unfreeze()
        for client in (c for per_target in clients.values() for c in per_target):
            await client.aclose()
    order = {t.name: i for i, t in enumerate(targets)}
    rows = [s.row(name, c, stream, redis_counted=name.startswith("edgeserve") and bool(redis_pids))
            for (name, c, stream), s in samples.items()]
    return sorted(rows, key=lambda r: (r.concurrency, r.stream, order.get(r.target, 99)))


# ---------------------------------------------------------------- processes

def ensure_litellm(venv: Path) -> tuple[Path | None, str | None, str]:
    """(litellm executable, version, note): installs litellm[proxy] into `venv` on first use, showing pip's output."""
    exe, python = venv / "bin" / "litellm", venv / "bin" / "python"
    try:
        if not exe.exists():
            print(f"installing litellm[proxy] into {venv} (first run only; a few minutes) ...", file=sys.stderr,
                  flush=True)
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            subprocess.run([str(python), "-m", "pip", "install", "litellm[proxy]"], check=True,
                           stdout=sys.stderr)
        version = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('litellm'))"],
                                 check=True, capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as exc:
        return None, None, f"litellm[proxy] did not install into {venv}: {exc}"
    return exe, version, "ok"


def _has_modules(python: str, names: list[str]) -> dict[str, bool]:
    code = "import importlib.util as u, sys; print(' '.join(str(u.find_spec(n) is not None) for n in sys.argv[1:]))"
    try:
        out = subprocess.run([python, "-c", code, *names], check=True, capture_output=True, text=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        return {}
    return {n: v == "True" for n, v in zip(names, out)}


def _litellm_config(path: Path, standin_url: str, master_key: str) -> None:
    path.write_text(f"""model_list:
  - model_name: {MODEL}
    litellm_params:
      model: openai/{MODEL}
      api_base: {standin_url}/v1
      api_key: dummy
general_settings:
  master_key: {master_key}
""")


QUOTA_LIMITS = {"requests_per_minute": 10**9, "tokens_per_day": 10**15}  # enforced, never reached


async def _tenant_tokens(redis_url: str) -> dict[str, str]:
    """API tokens of two new tenants: "" without quotas, "+quota" with `QUOTA_LIMITS`."""
    import redis.asyncio as aioredis

    from gateway.tenants import TenantStore

    client = aioredis.Redis.from_url(redis_url)
    try:
        store = TenantStore(client)
        tokens = {}
        for suffix, limits in (("", {}), ("+quota", QUOTA_LIMITS)):
            tenant = await store.create_tenant(f"bench-gateway{suffix}", **limits)
            tokens[suffix] = (await store.create_key(tenant.id)).token
        return tokens
    finally:
        await client.aclose()


def _source_tree(ref: str, into: Path) -> str:
    """Extract commit `ref` of this checkout into `into` (`git archive`); its short hash."""
    root = Path(__file__).resolve().parent.parent
    commit = subprocess.run(["git", "rev-parse", "--short", ref], cwd=root, check=True, capture_output=True,
                            text=True).stdout.strip()
    into.mkdir(parents=True)
    archive = subprocess.Popen(["git", "archive", "--format=tar", commit], cwd=root, stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(into)], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        raise RuntimeError(f"git archive {commit} failed")
    return commit


# ---------------------------------------------------------------- command

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=32, help="tokens per response, N (default 32)")
    p.add_argument("--concurrency", default=None, help="comma-separated (default 1,16,64; quick 1,16)")
    p.add_argument("--rounds", type=int, default=None, help="repetitions of every setting (default 6; quick 2)")
    p.add_argument("--round-seconds", type=float, default=None, help="measured seconds per round (default 2; "
                                                                       "quick 0.75)")
    p.add_argument("--no-litellm", action="store_true", help="skip LiteLLM (no install, no proxy)")
    p.add_argument("--baseline", default=None, metavar="REF",
                   help="also measure the gateway of git commit REF (e.g. HEAD~1), in the same rounds")
    p.add_argument("--litellm-venv", default=str(LITELLM_VENV))


def run(args: argparse.Namespace) -> int:
    from ops.pull import resolve_model
    from ops.standin_worker import token_text

    quick = args.quick
    points = [int(c) for c in args.concurrency.split(",")] if args.concurrency else ([1, 16] if quick else [1, 16, 64])
    rounds = args.rounds or (2 if quick else 6)
    duration_s = args.round_seconds or (0.75 if quick else 2.0)
    warmup_s = min(0.25, duration_s / 3)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    started = time.perf_counter()
    machine = machine_info()

    resolve_model(MODEL)  # pulled once, with progress, before anything starts
    litellm_exe, litellm_version, litellm_note = (None, None, "skipped (--no-litellm)")
    if not args.no_litellm:
        litellm_exe, litellm_version, litellm_note = ensure_litellm(Path(args.litellm_venv))
        log(f"litellm: {litellm_version or litellm_note}")
    servers = {"edgeserve": _has_modules(sys.executable, ["uvloop", "httptools"])}
    if litellm_exe is not None:
        servers["litellm"] = _has_modules(str(Path(args.litellm_venv) / "bin" / "python"), ["uvloop", "httptools"])

    with contextlib.ExitStack() as stack:
        targets, litellm_note, baseline = _start_targets(stack, args.tokens, litellm_exe, litellm_note,
                                                         args.baseline, log)
        content_checks = asyncio.run(_check_all(targets, args.tokens, token_text(args.tokens)[1]))
        for name, problem in content_checks.items():
            if problem:
                log(f"warning: {name} does not return the stand-in's text: {problem}")
        log(f"measuring {', '.join(t.name for t in targets)}: c={points}, stream and not, {rounds} rounds of "
            f"{duration_s:g} s each (+{warmup_s:g} s warm-up), N={args.tokens} tokens")
        rows = asyncio.run(measure(targets, points, [False, True], args.tokens, rounds, duration_s, warmup_s, log))
    total_s = time.perf_counter() - started

    cmp = compare(rows)
    have_litellm = any(r.target == "litellm" for r in rows)
    print(f"\nedgeserve bench gateway  N={args.tokens} tokens/response, {rounds} rounds x {duration_s:g} s per "
          f"target and setting{' (quick)' if quick else ''}")
    print(f"machine: {machine['cpus_usable']} CPUs ({machine['cpu_model']}), shared by the load generator, the "
          f"stand-in worker, the proxy and Redis")
    print(f"litellm: {litellm_version if have_litellm else 'unavailable: ' + litellm_note}; "
          f"uvloop/httptools: " + ", ".join(f"{k} {v}" for k, v in servers.items()))
    _print_table(rows, cmp)
    print("added = target - direct at the same setting; cpu ms/req = the proxy's CPU (+ Redis's for edgeserve) "
          f"per request; took {total_s:.0f} s")

    keys = [setting_key(c, s) for c in points for s in (False, True)]
    names = [t.name for t in targets]
    rps = {t: ({r.key: r.rps for r in rows if r.target == t} or None) for t in (*TARGETS, *names)}
    edge, quota = cmp.get("edgeserve", {}), cmp.get("edgeserve+quota", {})
    added = {t: {k: {q: v[f"added_{q}_ms"] for q in ("p50", "p95", "p99")} for k, v in per.items()}
             for t, per in cmp.items() if t != "direct"}
    report = {
        "quick": quick,
        "machine": machine,
        "config": {"tokens": args.tokens, "concurrency": points, "rounds": rounds, "round_seconds": duration_s,
                   "warmup_seconds": warmup_s, "settings": keys, "model": MODEL,
                   "latency": "non-stream: full response; stream: last byte; ttft: first body bytes"},
        "headline": {"target": "edgeserve+quota", "target_added_p50_ms": 2.0,
                     **{k: added.get("edgeserve+quota", {}).get(k) for k in ("c1_nostream", "c1_stream")}},
        "added_latency_ms": added,
        "added_latency_p50_ms": {k: v["added_p50_ms"] for k, v in edge.items()},
        "added_latency_p99_ms": {k: v["added_p99_ms"] for k, v in edge.items()},
        "rps": rps,
        "rps_ratio_edgeserve_vs_litellm": {k: v["rps_ratio_vs_litellm"] for k, v in edge.items()}
        if have_litellm else None,
        "rps_ratio_edgeserve_quota_vs_litellm": {k: v["rps_ratio_vs_litellm"] for k, v in quota.items()}
        if have_litellm else None,
        "baseline": None if baseline is None else {"ref": args.baseline, "commit": baseline,
                                                   "vs_baseline": _vs_baseline(rows, cmp, baseline)},
        "comparison": cmp,
        "litellm": {"available": have_litellm, "version": litellm_version, "note": litellm_note},
        "servers_have": servers,
        "content_checks": content_checks,
        "rows": [asdict(r) for r in rows],
        "total_s": total_s,
    }
    path = write_report(args.json_path, report)
    png = path.with_suffix(".png")
    if _plot(rows, cmp, f"gateway overhead, N={args.tokens} tokens, {machine['cpus_usable']} shared CPUs", png):
        print(f"wrote {png}")
    return 0


def _vs_baseline(rows: list[Row], cmp: dict[str, dict[str, dict[str, Any]]], commit: str
                 ) -> dict[str, dict[str, dict[str, float | None]]]:
    """Per tenant kind and setting: added p50 and proxy CPU ms/request, this tree over the baseline's."""
    by = {(r.target, r.key): r for r in rows}
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for kind in ("edgeserve", "edgeserve+quota"):
        for key, entry in cmp.get(kind, {}).items():
            old, new, base = cmp.get(f"{kind}@{commit}", {}).get(key), entry, by.get((f"{kind}@{commit}", key))
            ratio = lambda a, b: a / b if a is not None and b else None  # noqa: E731
            out.setdefault(kind, {})[key] = {
                "added_p50_ratio": ratio(new["added_p50_ms"], old and old["added_p50_ms"]),
                "cpu_ms_per_request_ratio": ratio(by[(kind, key)].proxy_cpu_ms_per_request,
                                                  base and base.proxy_cpu_ms_per_request)}
    return out


def _start_targets(stack: contextlib.ExitStack, num_tokens: int, litellm_exe: Path | None, litellm_note: str,
                   baseline_ref: str | None, log: Callable[[str], None]) -> tuple[list[Target], str, str | None]:
    """Start Redis, the stand-in, the gateway (with two tenants), the baseline's gateway and LiteLLM if
    asked; stopped by `stack`. Returns the targets, LiteLLM's note and the baseline's short commit."""
    from ops.redis_server import free_port, run_redis_server

    logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="edgeserve-bench-gateway-")))
    redis_url = stack.enter_context(run_redis_server())
    standin_url = f"http://127.0.0.1:{free_port()}"
    standin = stack.enter_context(child_process(
        [sys.executable, "-m", "ops.bench_gateway", "--port", standin_url.rsplit(":", 1)[1],
         "--tokens", str(num_tokens)], logs / "standin.log"))
    gateway_argv = ["gateway", "--model", MODEL, "--worker", standin_url, "--redis-url", redis_url,
                    "--served-name", MODEL]
    gateways: dict[str, tuple[subprocess.Popen, str]] = {}
    baseline = None if baseline_ref is None else _source_tree(baseline_ref, logs / "baseline")
    for suffix, tree in (("", None), *((() if baseline is None else ((f"@{baseline}", logs / "baseline"),)))):
        port = free_port()
        # The baseline's packages first on sys.path (they shadow this checkout's), then its CLI as `-m` would run.
        argv = ([sys.executable, "-m", "ops.cli"] if tree is None else [
            sys.executable, "-c", f"import runpy, sys; sys.path.insert(0, {str(tree)!r}); "
                                  "runpy.run_module('ops.cli', run_name='__main__', alter_sys=True)"])
        proc = stack.enter_context(child_process([*argv, *gateway_argv, "--port", str(port)],
                                                 logs / f"gateway{suffix}.log"))
        gateways[suffix] = proc, f"http://127.0.0.1:{port}"
    litellm = None
    if litellm_exe is not None:  # starts while the others come up; it is the slowest
        litellm_port, master_key = free_port(), "sk-bench-" + secrets.token_hex(8)
        _litellm_config(logs / "litellm.yaml", standin_url, master_key)
        litellm = stack.enter_context(child_process(
            [str(litellm_exe), "--config", str(logs / "litellm.yaml"), "--host", "127.0.0.1",
             "--port", str(litellm_port)], logs / "litellm.log", env={"LITELLM_LOCAL_MODEL_COST_MAP": "True"}))
    wait_http(f"{standin_url}/health", standin, logs / "standin.log", "the stand-in worker", 30)
    tokens = asyncio.run(_tenant_tokens(redis_url))
    targets = [Target("direct", f"{standin_url}/v1/chat/completions", {}, None),
               Target("worker", f"{standin_url}/v1/generate", {}, None, worker_body(num_tokens))]
    for suffix, (proc, url) in gateways.items():
        wait_http(f"{url}/healthz", proc, logs / f"gateway{suffix}.log", f"the edgeserve gateway{suffix}", 60)
        targets += [Target(f"edgeserve{kind}{suffix}", f"{url}/v1/chat/completions",
                           {"authorization": f"Bearer {token}"}, proc.pid) for kind, token in tokens.items()]
    if litellm is not None:
        litellm_url = f"http://127.0.0.1:{litellm_port}"
        try:
            wait_http(f"{litellm_url}/health/liveliness", litellm, logs / "litellm.log", "LiteLLM's proxy", 180)
            targets.append(Target("litellm", f"{litellm_url}/v1/chat/completions",
                                  {"authorization": f"Bearer {master_key}"}, litellm.pid))
        except Exception as exc:  # noqa: BLE001 - LiteLLM is a comparison, not a requirement
            litellm_note = f"installed but did not start: {exc}"
            log(f"litellm: {litellm_note}")
    return targets, litellm_note, baseline


def _print_table(rows: list[Row], cmp: dict[str, dict[str, dict[str, Any]]]) -> None:
    width = max(10, *(len(r.target) + 2 for r in rows))
    print(f"{'target':<{width}}{'c':>4} {'stream':<7}{'rps':>9}{'p50 ms':>9}{'p95 ms':>9}{'p99 ms':>9}"
          f"{'ttft p50':>10}{'added p50':>11}{'added p95':>11}{'added p99':>11}{'rps/litellm':>13}"
          f"{'cpu ms/req':>12}{'errors':>8}")
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for r in rows:
        e = cmp[r.target][r.key]
        cpu = None if r.proxy_cpu_ms_per_request is None else (
            r.proxy_cpu_ms_per_request + (r.redis_cpu_ms_per_request or 0.0))
        print(f"{r.target:<{width}}{r.concurrency:>4} {'yes' if r.stream else 'no':<7}{r.rps:>9.1f}"
              f"{r.p50_ms:>9.2f}{fmt(r.p95_ms, '.2f'):>9}{r.p99_ms:>9.2f}{fmt(r.ttft_p50_ms, '.2f'):>10}"
              f"{fmt(e['added_p50_ms'], '+.2f'):>11}{fmt(e['added_p95_ms'], '+.2f'):>11}"
              f"{fmt(e['added_p99_ms'], '+.2f'):>11}{fmt(e['rps_ratio_vs_litellm'], '.2f'):>13}"
              f"{fmt(cpu, '.2f'):>12}{r.errors:>8}")


async def _check_all(targets: list[Target], num_tokens: int, expected: str) -> dict[str, str | None]:
    import httpx

    async with httpx.AsyncClient(timeout=60) as client:
        return {t.name: await expected_text_check(client, t, num_tokens, expected) for t in targets if t.body is None}


def _plot(rows: list[Row], cmp: dict[str, dict[str, dict[str, Any]]], title: str, path: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no PNG", file=sys.stderr)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(dict.fromkeys(r.key for r in rows))
    targets = list(dict.fromkeys(r.target for r in rows))
    palette = ("tab:gray", "tab:olive", "tab:blue", "tab:cyan", "tab:purple", "tab:pink", "tab:orange")
    colours = dict(zip(targets, palette))
    by = {(r.target, r.key): r for r in rows}
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.8 / len(targets)
    for i, t in enumerate(targets):
        xs = [k + (i - (len(targets) - 1) / 2) * width for k in range(len(keys))]
        left.bar(xs, [by[(t, k)].rps if (t, k) in by else 0 for k in keys], width, label=t, color=colours.get(t))
        if t != "direct":
            right.bar(xs, [cmp[t].get(k, {}).get("added_p50_ms") or 0 for k in keys], width, label=t,
                      color=colours.get(t))
    for ax, ylabel in ((left, "requests/s"), (right, "added p50 latency vs direct (ms)")):
        ax.set_xticks(range(len(keys)), keys, rotation=20)
        ax.set_ylabel(ylabel)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    """`python -m ops.bench_gateway --port P --tokens N`: serve the per-token stand-in (the bench starts it)."""
    import uvicorn

    p = argparse.ArgumentParser(prog="python -m ops.bench_gateway", description=per_token_standin_app.__doc__)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tokens", type=int, default=32)
    args = p.parse_args(argv)
    uvicorn.run(per_token_standin_app(args.tokens), host="127.0.0.1", port=args.port, log_level="warning",
                access_log=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
