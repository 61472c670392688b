"""`edgeserve bench pd`'s requests to workers over the worker protocol (greedy, EOS ignored, every token
event timed on both clocks) and the `/stats` snapshots taken around them: transfer counters,
prefix-cache counters, and waiting until a worker is idle with every page back."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ops.bench.harness.stats import ratio

if TYPE_CHECKING:
    from backend.worker_client import WorkerClient

__all__ = ["RequestRecord", "send", "closed_loop", "stats", "is_idle", "wait_idle", "transfer_delta",
           "hit_rate_delta"]


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
    """The worker's `/stats` snapshot."""
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


def transfer_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """What a worker's `/stats` kv_transfer counters did between two snapshots."""
    d = {k: after[k] - before[k] for k in ("transfers", "failed", "bytes", "tokens", "seconds")}
    d["bytes_per_token"] = ratio(d["bytes"], d["tokens"])
    return d


def hit_rate_delta(before: dict[str, Any], after: dict[str, Any]) -> float:
    """Prefix-cache hit rate (hit tokens / query tokens) between two `/stats` prefix_cache snapshots."""
    return ratio(after["hit_tokens"] - before["hit_tokens"], after["query_tokens"] - before["query_tokens"])
