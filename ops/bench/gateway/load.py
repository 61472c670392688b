"""`edgeserve bench gateway`'s load generator: closed-loop OpenAI clients, one keep-alive connection per
simulated user, rounds interleaved across targets, and the latency, TTFT and proxy CPU they collect.

Every repetition visits every setting (c x stream) and within it every target, the order rotating,
so a burst of machine noise lands on all targets rather than one. The load generator's own
garbage collector runs only between rounds; CPU time of a proxy (and of Redis) is read from
/proc around each measured round.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec

from backend.heap import freeze_heap
from ops.bench.harness.procs import cpu_seconds, descendants, named_descendants
from ops.bench.harness.stats import percentile

if TYPE_CHECKING:
    import httpx

__all__ = ["MODEL", "Row", "Target", "RoundResult", "setting_key", "request_body", "worker_body", "run_round",
           "expected_text_check", "measure"]

MODEL = "smollm2-135m"


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
    cpu_rounds_ms: list[float] = field(default_factory=list)  # CPU ms per request as above (+ Redis's), per round

    @property
    def key(self) -> str:
        return setting_key(self.concurrency, self.stream)


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
    """A non-streamed chat request as the gateway sends it on: its prompt ids (the model's chat template), N tokens,
    `stream=False` (the worker may hold its lines and write them together, `backend/event_frames.py`)."""
    from backend.protocol import GenerateRequest
    from backend.sampling_params import SamplingParams
    from backend.tokenizer import Tokenizer
    from ops.pull import resolve_model

    messages = msgspec.json.decode(request_body(num_tokens, False))["messages"]
    prompt_ids = Tokenizer.from_model_dir(resolve_model(MODEL, progress=False)).encode_chat(messages)
    return msgspec.json.encode(GenerateRequest(prompt_ids, SamplingParams(max_tokens=num_tokens), model=MODEL,
                                               stream=False))


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
    cpu_rounds: list[tuple[float, float]] = field(default_factory=list)  # (proxy, Redis) CPU s per request

    def add(self, res: RoundResult, proxy_cpu_s: float, redis_cpu_s: float) -> None:
        self.latencies += res.latencies
        self.ttfts += res.ttfts
        self.errors.update(res.errors)
        self.seconds += res.seconds
        self.proxy_cpu_s += proxy_cpu_s
        self.redis_cpu_s += redis_cpu_s
        self.p50_rounds_ms.append(1e3 * percentile(res.latencies, 0.5))
        self.rps_rounds.append(len(res.latencies) / res.seconds)
        if res.latencies:
            self.cpu_rounds.append((proxy_cpu_s / len(res.latencies), redis_cpu_s / len(res.latencies)))

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
                   p50_rounds_ms=self.p50_rounds_ms, rps_rounds=self.rps_rounds,
                   cpu_rounds_ms=[] if target in ("direct", "worker") else
                   [1e3 * (proxy + (redis if redis_counted else 0.0)) for proxy, redis in self.cpu_rounds])


async def measure(targets: list[Target], points: list[int], streams: list[bool], num_tokens: int, rounds: int,
                  duration_s: float, warmup_s: float, log: Callable[[str], None]) -> list[Row]:
    """Every repetition visits every setting, and within it every target (order rotating); one Row each."""
    import httpx

    # One client (one keep-alive connection) per simulated user: a single AsyncClient shared by c tasks
    # queues them in httpcore's pool, which here halved direct's requests/s at c=16 and put a 10x tail on p99.
    tls = ssl.create_default_context()  # never used (plain http on loopback); made once instead of per client
    clients = {t.name: [httpx.AsyncClient(verify=tls, timeout=httpx.Timeout(60.0)) for _ in range(max(points))]
               for t in targets}
    redis_pids = named_descendants("redis-server")
    samples: dict[tuple[str, int, bool], _Samples] = {}
    # This process holds torch (the bench registry imports it): a full collection walks ~200k objects,
    # ~0.1 s, which would land in some target's latencies. Freeze what exists, collect only between rounds.
    freeze_heap()
    try:
        settings = [(c, stream) for c in points for stream in streams]
        for rep in range(rounds):
            for i, (c, stream) in enumerate(settings):
                turn = (rep + i) % len(targets)
                for target in targets[turn:] + targets[:turn]:
                    if target.body is not None and stream:
                        continue  # the worker's request is the gateway's non-streamed one: non-stream settings only
                    users, body = clients[target.name], target.body or request_body(num_tokens, stream)
                    await run_round(users, target, c, stream, body, warmup_s)
                    pids = descendants(target.pid) if target.pid else []
                    gc.collect()
                    gc.disable()
                    cpu0, redis0 = cpu_seconds(pids), cpu_seconds(redis_pids)
                    res = await run_round(users, target, c, stream, body, duration_s)
                    cpu, redis = cpu_seconds(pids) - cpu0, cpu_seconds(redis_pids) - redis0
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
