"""Routing policies compared: prefix-aware vs round-robin vs least-loaded, on 4 real workers.

Processes, all on this machine: Redis (`ops.redis_server`), four unified workers
(`edgeserve serve --model smollm2-135m --threads 1 --prefix-caching --redis-url R
--worker-id wN --kv-cache-bytes 256M`, subprocesses that heartbeat into the
registry and publish their prefix-cache KV events) and one gateway
(`edgeserve gateway --policy P`, no ``--worker``: it routes over the registry).
Cold caches: the workers and the gateway are restarted for every policy run (same
worker ids, same Redis, same tenants), so each run starts with empty prefix
caches, an empty prefix index and a gateway with nothing in flight. Each worker
is warmed up (one short request) before anything is measured.

Rounds: every policy runs once per round (``--rounds``, default one per policy),
the order rotated each round (`round_order`, a Latin rotation: round r starts at
the r-th policy), so over the rounds each policy runs first, in the middle and last
once: a slow spell of this shared machine, or whatever the previous run left
behind (page cache, memory), does not always fall on the same policy.

Workload (`make_workload`, seeded; identical for every policy): T tenants (8),
each with its own API key and its own system prompt: a support-assistant
preamble and ~300 words (~400 tokens) of one Brown-corpus document (a different
document, so a different genre, per tenant). Each tenant has C conversations
(3; quick 1) of K turns (4; quick 3); turn k sends the whole conversation so far
(system, the previous user questions and assistant answers, a new question) to
``POST /v1/chat/completions``, streaming, ``max_tokens`` 16, temperature 0,
``stream_options.include_usage``. The assistant messages sent back are scripted
(a sentence of the tenant's document), not the model's reply: the workload then
does not depend on what the model says, and a worker caches only prompt blocks,
so what was generated never matters for the cache. Conversations run in a
seeded shuffled order, closed loop: U users (8), each takes the next
conversation and plays its turns back to back.

Measured per policy, pooled over its rounds (all requests of all its runs; each
round's own figures and the targets' verdicts per round are in the JSON):
- hit rate: sum of ``usage.prompt_tokens_details.cached_tokens`` / sum of
  ``usage.prompt_tokens`` (token-weighted, not a mean of ratios); cross-checked
  against the change in the workers' own ``/stats`` prefix_cache counters
  (hit_tokens / query_tokens, summed over workers);
- TTFT p50/p95 (client clock: request sent -> first chunk with content;
  nearest-rank, `ops.bench_engine.percentile`);
- throughput: requests/s and output tokens/s over the run's wall time;
- load per worker: requests (from the ``x-edgeserve-worker`` header, a tag of the worker id) and prompt
  tokens computed (prompt - cached); `max_over_mean` = the busiest worker's
  share over the mean of all four (an idle worker counts as 0);
- diagnostics: the share of later turns sent to the worker of the previous turn
  (`same_worker_rate`), and for the prefix policy the share of routes whose
  "N cached blocks" (``x-edgeserve-route``) equals what the worker then served
  from cache (`overlap_agreement`: is the prefix index in step with the caches?).
Targets (prefix policy): hit rate >= 2x round-robin's; TTFT p50 below both
baselines; no worker above 1.5x the mean request load. For scale, the hit-rate
ceiling (`ceiling_hit_rate`: one infinite cache shared by all workers, requests
in workload order) is printed too: round-robin also hits once a tenant's system
prompt has reached a worker, so 2x round-robin can lie above what any router
could reach.

This machine has few cores (often 2) and other people's processes run on it:
four single-threaded workers, the gateway, Redis and this load generator share
them, so the workers are CPU-starved and absolute numbers are low. The
comparison is what matters; the load average is recorded before and after each
policy. Each worker holds about 3 GiB resident, so four need ~13 GiB free: the run
refuses to start them with less (`--allow-low-memory` overrides). Worker and gateway
logs are scanned for warnings and errors.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

from gateway.generation import worker_tag
from ops.bench.report import write_report
from ops.bench.harness.stats import percentile, rotated, spread
from ops.cluster import child_process, machine_info, wait_http

__all__ = ["add_arguments", "run", "Conversation", "TurnResult", "PolicySummary", "make_workload",
           "turn_messages", "hit_rate", "max_over_mean", "ceiling_hit_rate", "same_worker_rate",
           "overlap_agreement", "summarize", "check_targets", "round_order", "targets_by_round", "POLICIES"]

MODEL = "smollm2-135m"
POLICIES = ("prefix", "round-robin", "least-loaded")
NUM_WORKERS = 4
WORKER_RSS_GIB = 3.0  # one warmed-up worker's resident memory, measured here (SmolLM2-135M, 256M KV; was 2.8 idle)


# ---------------------------------------------------------------- workload

class Conversation(NamedTuple):
    tenant: int  # index into the tenants (and their API keys)
    index: int  # this conversation's number within its tenant
    system: str
    turns: list[tuple[str, str]]  # (user question, scripted assistant answer) per turn


def _sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", text) if 4 <= len(s.split()) <= 30]


def make_workload(documents: Sequence[str], tenants: int, conversations: int, turns: int, seed: int,
                  system_words: int = 300) -> list[Conversation]:
    """`tenants` x `conversations` conversations of `turns` turns, in a seeded shuffled order.

    Tenant t's system prompt is a preamble and the first `system_words` words of
    documents[t]; questions ask about words of that document, answers are its sentences.
    """
    if len(documents) < tenants:
        raise ValueError(f"{tenants} tenants need {tenants} documents, got {len(documents)}")
    rng = random.Random(seed)
    out: list[Conversation] = []
    for t in range(tenants):
        words = documents[t].split()
        system = (f"You are the support assistant of company {t + 1}. Answer the user's questions in one short "
                  f"sentence, using only this reference document.\n\n" + " ".join(words[:system_words]))
        topics = sorted({w.strip(".,;:!?\"'()") for w in words[:system_words] if len(w) >= 6}) or ["the text"]
        answers = _sentences(" ".join(words[:system_words])) or ["I do not know."]
        for c in range(conversations):
            qa = [(f"Question {k + 1}: what does the document say about \"{rng.choice(topics)}\"?",
                   rng.choice(answers)) for k in range(turns)]
            out.append(Conversation(t, c, system, qa))
    rng.shuffle(out)
    return out


def turn_messages(conv: Conversation, k: int) -> list[dict[str, str]]:
    """Messages of turn `k` (0-based): the system prompt, turns 0..k-1 with their answers, question k."""
    messages = [{"role": "system", "content": conv.system}]
    for user, assistant in conv.turns[:k]:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    messages.append({"role": "user", "content": conv.turns[k][0]})
    return messages


def brown_documents(n: int, min_words: int) -> list[str]:
    """The first `n` Brown-corpus documents (genre-round-robin) with at least `min_words` words."""
    from ops.brown_corpus import fetch_brown, iter_documents

    docs = [text for _, text in iter_documents(fetch_brown()) if len(text.split()) >= min_words]
    return docs[:n]


# ---------------------------------------------------------------- measures

@dataclass
class TurnResult:
    tenant: int
    conversation: int
    turn: int
    worker: str  # worker id ("" when the gateway did not name one)
    sent_at: float  # seconds since the run started
    ttft_s: float | None  # to the first chunk with content
    latency_s: float
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    route: str = ""  # the gateway's x-edgeserve-route reason
    error: str | None = None
    round: int = 0  # which round of the policy (a conversation recurs once per round)


def hit_rate(results: Sequence[TurnResult]) -> float:
    """Prompt tokens served from cache / prompt tokens, over the successful requests."""
    ok = [r for r in results if r.error is None]
    prompt = sum(r.prompt_tokens for r in ok)
    return sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0


def max_over_mean(loads: dict[str, float], workers: Sequence[str]) -> float:
    """The busiest worker's load over the mean of all `workers` (absent = 0); 1.0 is perfectly even."""
    values = [loads.get(w, 0) for w in workers]
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean else 0.0


class PolicySummary(NamedTuple):
    policy: str
    requests: int
    errors: int
    wall_s: float
    hit_rate: float
    ttft_p50_s: float
    ttft_p95_s: float
    latency_p50_s: float
    requests_per_s: float
    output_tok_s: float
    requests_per_worker: dict[str, int]
    computed_tokens_per_worker: dict[str, int]  # prompt - cached
    max_over_mean_load: float  # over requests
    max_over_mean_computed: float  # over computed prompt tokens
    hit_rate_by_turn: dict[int, float]
    same_worker_rate: float  # later turns sent to the worker of the conversation's previous turn
    overlap_agreement: float  # requests whose router-predicted cached blocks match the worker's cached tokens


def ceiling_hit_rate(prompts: Sequence[tuple[int, Sequence[int]]], page_size: int = 16) -> float:
    """The best hit rate any router could get: one infinite prefix cache shared by every worker, fed the
    (tenant, prompt ids) in order. Like a worker, it matches whole blocks, at most (len - 1) // page_size."""
    from prefix_cache.hashing import block_hashes

    seen: set[bytes] = set()
    cached = total = 0
    for tenant, ids in prompts:
        hashes = block_hashes(ids, page_size, str(tenant))
        hits = 0
        while hits < min(len(hashes), (len(ids) - 1) // page_size) and hashes[hits] in seen:
            hits += 1
        cached, total = cached + hits * page_size, total + len(ids)
        seen.update(hashes)
    return cached / total if total else 0.0


def same_worker_rate(results: Sequence[TurnResult]) -> float:
    """Of the successful turns after the first, the share that ran where the previous turn of its conversation ran."""
    where = {(r.round, r.tenant, r.conversation, r.turn): r.worker for r in results if r.error is None}
    later = [(w, where.get((n, t, c, k - 1))) for (n, t, c, k), w in where.items() if k > 0]
    return sum(1 for w, prev in later if w == prev) / len(later) if later else 0.0


def overlap_agreement(results: Sequence[TurnResult], page_size: int = 16) -> float:
    """Share of prefix-routed requests whose route reason's "N cached blocks" equals cached tokens / page size
    (the prefix index agrees with the worker's cache); NaN when no route names its overlap."""
    pairs = [(int(m.group(1)), r.cached_tokens // page_size) for r in results if r.error is None
             for m in [re.search(r"(\d+) cached blocks", r.route)] if m]
    return sum(1 for a, b in pairs if a == b) / len(pairs) if pairs else float("nan")


def summarize(policy: str, results: Sequence[TurnResult], workers: Sequence[str], wall_s: float) -> PolicySummary:
    ok = [r for r in results if r.error is None]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    per_worker = {w: sum(1 for r in ok if r.worker == w) for w in workers}
    computed = {w: sum(r.prompt_tokens - r.cached_tokens for r in ok if r.worker == w) for w in workers}
    turns = sorted({r.turn for r in ok})
    return PolicySummary(
        policy=policy, requests=len(results), errors=len(results) - len(ok), wall_s=wall_s, hit_rate=hit_rate(ok),
        ttft_p50_s=percentile(ttfts, 0.5), ttft_p95_s=percentile(ttfts, 0.95),
        latency_p50_s=percentile([r.latency_s for r in ok], 0.5),
        requests_per_s=len(ok) / wall_s if wall_s else 0.0,
        output_tok_s=sum(r.completion_tokens for r in ok) / wall_s if wall_s else 0.0,
        requests_per_worker=per_worker, computed_tokens_per_worker=computed,
        max_over_mean_load=max_over_mean(per_worker, workers),
        max_over_mean_computed=max_over_mean(computed, workers),
        hit_rate_by_turn={t: hit_rate([r for r in ok if r.turn == t]) for t in turns},
        same_worker_rate=same_worker_rate(ok), overlap_agreement=overlap_agreement(ok))


def check_targets(s: dict[str, PolicySummary]) -> list[dict[str, Any]]:
    """The prefix policy's targets (target, value, threshold, met); those needing an absent policy are left out."""
    out = []
    p, rr, ll = s.get("prefix"), s.get("round-robin"), s.get("least-loaded")
    if p is not None and rr is not None:
        out.append({"target": "hit rate prefix >= 2x round-robin", "value": p.hit_rate,
                    "threshold": 2 * rr.hit_rate, "met": p.hit_rate >= 2 * rr.hit_rate})
    if p is not None and (rr is not None or ll is not None):
        best = min(b.ttft_p50_s for b in (rr, ll) if b is not None)
        out.append({"target": "TTFT p50 prefix < both baselines", "value": p.ttft_p50_s, "threshold": best,
                    "met": p.ttft_p50_s < best})
    if p is not None:
        out.append({"target": "prefix: no worker > 1.5x mean load (requests)", "value": p.max_over_mean_load,
                    "threshold": 1.5, "met": 0 < p.max_over_mean_load <= 1.5})
    return out


def round_order(policies: Sequence[str], rounds: int) -> list[list[str]]:
    """The policies' run order in each round: a Latin rotation (round r starts at policy r), so over
    len(policies) rounds every policy runs in every position (first, after a warm machine, last) once."""
    return [rotated(list(policies), r) for r in range(rounds)]


def targets_by_round(per_round: Sequence[dict[str, PolicySummary]]) -> dict[str, list[bool]]:
    """Every target's verdict in each round, from that round's figures alone."""
    out: dict[str, list[bool]] = {}
    for summaries in per_round:
        for c in check_targets(summaries):
            out.setdefault(c["target"], []).append(c["met"])
    return out


# ---------------------------------------------------------------- load generator

async def send_turn(client, url: str, token: str, messages: list[dict[str, str]], max_tokens: int,
                    worker_ids: dict[str, str], t0: float) -> tuple[TurnResult, str]:
    """One streamed chat request; returns its result (tenant/turn fields left 0) and the reply text."""
    body = {"model": MODEL, "messages": messages, "stream": True, "max_tokens": max_tokens, "temperature": 0,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    res = TurnResult(0, 0, 0, "", start - t0, None, 0.0)
    text: list[str] = []
    try:
        async with client.stream("POST", url, json=body, headers={"authorization": f"Bearer {token}"}) as resp:
            tag = resp.headers.get("x-edgeserve-worker", "")  # an opaque tag of the worker's id, never its URL
            res.worker = next((wid for wid in worker_ids.values() if worker_tag(wid) == tag), tag)
            res.route = resp.headers.get("x-edgeserve-route", "")
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
            else:
                done = False
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        done = True
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        res.error = f"in-stream error: {chunk['error']}"
                        break
                    for choice in chunk.get("choices", []):
                        piece = choice.get("delta", {}).get("content")
                        if piece:
                            if res.ttft_s is None:
                                res.ttft_s = time.perf_counter() - start
                            text.append(piece)
                    usage = chunk.get("usage")
                    if usage:
                        res.prompt_tokens, res.completion_tokens = usage["prompt_tokens"], usage["completion_tokens"]
                        res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                if res.error is None and not (done and res.prompt_tokens):
                    res.error = "stream ended without usage and [DONE]"
    except Exception as exc:  # noqa: BLE001 - counted as an error; the conversation goes on
        res.error = f"{type(exc).__name__}: {exc}"
    res.latency_s = time.perf_counter() - start
    return res, "".join(text)


async def drive(url: str, tokens: list[str], workload: list[Conversation], users: int, max_tokens: int,
                worker_ids: dict[str, str], log: Callable[[str], None]) -> tuple[list[TurnResult], float, str]:
    """Closed loop: `users` users, each playing whole conversations turn by turn; (results, wall s, a sample reply)."""
    import httpx

    pending = iter(workload)
    results: list[TurnResult] = []
    sample, finished = [""], [0]
    t0 = time.perf_counter()

    async def user() -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:
            for conv in pending:
                for k in range(len(conv.turns)):
                    res, text = await send_turn(client, url, tokens[conv.tenant], turn_messages(conv, k), max_tokens,
                                                worker_ids, t0)
                    res.tenant, res.conversation, res.turn = conv.tenant, conv.index, k
                    results.append(res)
                    sample[0] = sample[0] or text
                    if res.error is not None:
                        log(f"  error: tenant {conv.tenant} conversation {conv.index} turn {k}: {res.error}")
                finished[0] += 1
                if finished[0] % 8 == 0:
                    log(f"  {finished[0]} / {len(workload)} conversations done")

    await asyncio.gather(*(user() for _ in range(users)))
    return results, time.perf_counter() - t0, sample[0]


# ---------------------------------------------------------------- processes

async def _create_tenants(redis_url: str, n: int) -> list[str]:
    """n tenants without quotas, one API key each; their tokens."""
    import redis.asyncio as aioredis

    from gateway.tenants import TenantStore

    client = aioredis.Redis.from_url(redis_url)
    try:
        store = TenantStore(client)
        tenants = [await store.create_tenant(f"bench-routing-{i + 1}") for i in range(n)]
        return [(await store.create_key(t.id)).token for t in tenants]
    finally:
        await client.aclose()


def _wait_registered(redis_url: str, ids: list[str], timeout_s: float = 30.0) -> None:
    import redis

    from backend.errors import BackendUnavailable
    from backend.registration import record_key

    client = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if all(client.exists(record_key(MODEL, i)) for i in ids):
                return
            time.sleep(0.2)
    finally:
        client.close()
    raise BackendUnavailable(f"workers {ids} did not all register in {timeout_s:.0f} s")


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


def _start_fleet(stack: contextlib.ExitStack, redis_url: str, policy: str, kv_bytes: str, logs: Path,
                 log: Callable[[str], None], prefix: str = "") -> Fleet:
    """Start 4 workers and a gateway with `policy` (stopped by `stack`)."""
    from ops.redis_server import free_port

    workers: dict[str, str] = {}
    procs = []
    for n in range(1, NUM_WORKERS + 1):
        wid, port = f"w{n}", free_port()
        workers[f"http://127.0.0.1:{port}"] = wid
        path = logs / f"{prefix}{policy}-{wid}.log"
        procs.append((stack.enter_context(child_process(
            [sys.executable, "-m", "ops.cli", "serve", "--model", MODEL, "--port", str(port), "--threads", "1",
             "--prefix-caching", "--redis-url", redis_url, "--worker-id", wid, "--kv-cache-bytes", kv_bytes], path)),
            f"http://127.0.0.1:{port}/health", path, f"worker {wid}"))
    gateway_port = free_port()
    path = logs / f"{prefix}{policy}-gateway.log"
    procs.append((stack.enter_context(child_process(
        [sys.executable, "-m", "ops.cli", "gateway", "--model", MODEL, "--redis-url", redis_url,
         "--port", str(gateway_port), "--policy", policy], path)),
        f"http://127.0.0.1:{gateway_port}/healthz", path, "the gateway"))
    started = time.perf_counter()
    for proc, url, path, what in procs:
        wait_http(url, proc, path, what, 180)
    _wait_registered(redis_url, list(workers.values()))
    log(f"  4 workers + gateway ({policy}) up in {time.perf_counter() - started:.0f} s")
    return Fleet(f"http://127.0.0.1:{gateway_port}", workers, [(proc, path, what) for proc, _, path, what in procs])


async def _warm_up(worker_urls: list[str]) -> None:
    """One short request straight to each worker (no full block: nothing is cached or counted)."""
    import httpx

    async with httpx.AsyncClient(timeout=120) as client:
        for url in worker_urls:
            body = {"prompt_ids": list(range(100, 108)), "params": {"max_tokens": 4, "temperature": 0.0}}
            resp = await client.post(f"{url}/v1/generate", json=body)
            resp.raise_for_status()


async def _stats(worker_urls: list[str]) -> dict[str, dict[str, Any]]:
    import httpx

    async with httpx.AsyncClient(timeout=30) as client:
        return {url: (await client.get(f"{url}/stats")).json() for url in worker_urls}


def _worker_hits(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> tuple[int, int]:
    """Change in (hit_tokens, query_tokens) of the workers' prefix caches, summed over workers."""
    hit = sum(after[u]["prefix_cache"]["hit_tokens"] - before[u]["prefix_cache"]["hit_tokens"] for u in after)
    query = sum(after[u]["prefix_cache"]["query_tokens"] - before[u]["prefix_cache"]["query_tokens"] for u in after)
    return hit, query


def _turn_keys(workload: list[Conversation]) -> list[tuple[Conversation, int]]:
    return [(conv, k) for conv in workload for k in range(len(conv.turns))]


def _workload_prompt_ids(workload: list[Conversation]) -> list[tuple[int, list[int]]]:
    """(tenant, prompt token ids) of every request in workload order, as the gateway renders them."""
    from gateway.config import ModelRoute
    from gateway.served_models import ServedModel
    from ops.pull import resolve_model

    model = ServedModel(ModelRoute(name=MODEL, model_dir=str(resolve_model(MODEL))))
    return [(conv.tenant, model.chat_prompt_ids(turn_messages(conv, k))) for conv, k in _turn_keys(workload)]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _check_memory(allow: bool, log: Callable[[str], None]) -> None:
    """Refuse to start 4 workers without the memory they need (the kernel's OOM killer would pick a
    process, maybe someone else's), unless `allow`: then only warn."""
    free, need = _mem_available_gib(), NUM_WORKERS * WORKER_RSS_GIB + 1
    if free < need:
        msg = (f"{free:.1f} GiB of memory available; 4 workers need about {need:.0f} GiB: the kernel could kill "
               f"a process mid-run")
        if not allow:
            raise SystemExit(f"edgeserve bench routing: {msg} (--allow-low-memory to run anyway)")
        log(f"warning: {msg}")


def _mem_available_gib() -> float:
    with contextlib.suppress(OSError, IndexError, ValueError):
        return int(Path("/proc/meminfo").read_text().split("MemAvailable:")[1].split()[0]) / 2**20
    return float("nan")


def _scan_logs(logs: Path) -> dict[str, list[str]]:
    """Warning, error and traceback lines of every log (at most 10 per log)."""
    out = {}
    for path in sorted(logs.glob("*.log")):
        lines = [line for line in path.read_text(errors="replace").splitlines()
                 if re.search(r"WARNING|ERROR|Traceback|Exception", line)]
        if lines:
            out[path.stem] = lines[:10]
    return out


# ---------------------------------------------------------------- command

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated; round r starts at the r-th")
    p.add_argument("--rounds", type=int, default=None, help="rounds of every policy, the order rotated each round "
                   "(default: one per policy, a full Latin rotation)")
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--conversations", type=int, default=None, help="per tenant (default 3; quick 1)")
    p.add_argument("--turns", type=int, default=None, help="per conversation (default 4; quick 3)")
    p.add_argument("--users", type=int, default=8, help="closed-loop concurrency (default 8)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--system-words", type=int, default=300, help="corpus words per system prompt (~1.3 tokens each)")
    p.add_argument("--kv-cache-bytes", default="256M", help="each worker's KV pool (default 256M)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logs", default=None, help="keep worker and gateway logs here (default: a temporary folder)")
    p.add_argument("--allow-low-memory", action="store_true",
                   help="start the workers even with less memory available than they need (default: refuse)")


def run(args: argparse.Namespace) -> int:
    from ops.pull import resolve_model
    from ops.redis_server import run_redis_server

    quick = args.quick
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise SystemExit(f"unknown policies {unknown}; choose from {POLICIES}")
    conversations = args.conversations or (1 if quick else 3)
    turns = args.turns or (3 if quick else 4)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    started = time.perf_counter()
    machine = {**machine_info(), "load_avg_start": list(os.getloadavg()), "mem_available_gib_start": _mem_available_gib()}
    _check_memory(args.allow_low_memory, log)

    resolve_model(MODEL)
    workload = make_workload(brown_documents(args.tenants, args.system_words), args.tenants, conversations, turns,
                             args.seed, args.system_words)
    prompts = _workload_prompt_ids(workload)
    ceiling = ceiling_hit_rate(prompts)
    first_turn_tokens = _mean([len(ids) for (_, ids), (_, k) in zip(prompts, _turn_keys(workload)) if k == 0])
    log(f"workload: {args.tenants} tenants x {conversations} conversations x {turns} turns = "
        f"{len(workload) * turns} requests per policy, {args.users} users, max_tokens {args.max_tokens}; first turns "
        f"{first_turn_tokens:.0f} prompt tokens on average, all turns {_mean([len(i) for _, i in prompts]):.0f}; "
        f"hit-rate ceiling {ceiling:.1%}")
    order = round_order(policies, args.rounds or len(policies))
    rounds: list[dict[str, PolicySummary]] = [{} for _ in order]  # per round: policy -> its figures
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}  # per policy: one entry per round
    results: dict[str, list[TurnResult]] = {p: [] for p in policies}
    with contextlib.ExitStack() as outer:
        if args.logs:
            logs = Path(args.logs)
            logs.mkdir(parents=True, exist_ok=True)
        else:
            logs = Path(outer.enter_context(tempfile.TemporaryDirectory(prefix="edgeserve-bench-routing-")))
        redis_url = outer.enter_context(run_redis_server())
        tokens = asyncio.run(_create_tenants(redis_url, args.tenants))
        for n, these in enumerate(order):
            for policy in these:
                log(f"round {n}, policy {policy}: starting 4 workers and the gateway (cold caches)")
                _check_memory(args.allow_low_memory, log)
                with contextlib.ExitStack() as stack:
                    fleet = _start_fleet(stack, redis_url, policy, args.kv_cache_bytes, logs, log, f"r{n}-")
                    workers = fleet.workers
                    asyncio.run(_warm_up(list(workers)))
                    load_before = list(os.getloadavg())
                    before = asyncio.run(_stats(list(workers)))
                    got, wall_s, sample = asyncio.run(drive(f"{fleet.gateway_url}/v1/chat/completions", tokens,
                                                            workload, args.users, args.max_tokens, workers, log))
                    fleet.check_alive()
                    after = asyncio.run(_stats(list(workers)))
                for r in got:
                    r.round = n
                results[policy] += got
                s = rounds[n][policy] = summarize(policy, got, sorted(workers.values()), wall_s)
                hits = _worker_hits(before, after)
                runs[policy].append({"round": n, "position": these.index(policy), "summary": s._asdict(),
                                     "hit_rate_workers": hits[0] / hits[1] if hits[1] else 0.0, "worker_hits": hits,
                                     "load_avg": [load_before, list(os.getloadavg())], "sample_reply": sample,
                                     "worker_stats": {workers[u]: a["prefix_cache"] for u, a in after.items()}})
                log(f"  {policy}: hit rate {s.hit_rate:.1%}, TTFT p50 {s.ttft_p50_s:.2f} s, {wall_s:.0f} s, "
                    f"load avg {os.getloadavg()[0]:.1f}")
        problems = _scan_logs(logs)
    names = [f"w{i}" for i in range(1, NUM_WORKERS + 1)]
    summaries = {p: summarize(p, results[p], names, sum(run["summary"]["wall_s"] for run in runs[p]))
                 for p in policies}
    details = {p: {"hit_rate_workers": (sum(run["worker_hits"][0] for run in runs[p])
                                        / max(1, sum(run["worker_hits"][1] for run in runs[p]))),
                   "rounds": runs[p], "results": [asdict(r) for r in sorted(results[p], key=lambda r: (r.round,
                                                                                                    r.sent_at))]}
               for p in policies}
    total_s = time.perf_counter() - started
    machine["load_avg_end"] = list(os.getloadavg())
    machine["mem_available_gib_end"] = _mem_available_gib()
    checks = check_targets(summaries)
    held = targets_by_round(rounds)
    for c in checks:
        c["met_in_rounds"] = f"{sum(held[c['target']])}/{len(rounds)}"

    print(f"\nedgeserve bench routing  {args.tenants} tenants x {conversations} conversations x {turns} turns, "
          f"{args.users} users, {NUM_WORKERS} workers x 1 thread, KV {args.kv_cache_bytes} each"
          f"{' (quick)' if quick else ''}")
    print(f"machine: {machine['cpus_usable']} CPUs shared by 4 workers, the gateway, Redis and the load generator "
          f"(CPU-starved: compare policies, not absolute numbers); load average "
          f"{machine['load_avg_start'][0]:.1f} at start, {machine['load_avg_end'][0]:.1f} at end")
    _print_table(summaries, details)
    print("hit rate: cached / prompt tokens from the usage chunks ((workers): their /stats counters); TTFT: client "
          "clock to the first content chunk; same wkr: later turns on the worker of the previous turn")
    print(f"hit-rate ceiling for this workload (one infinite cache shared by all workers): {ceiling:.1%}")
    per_round = {p: {f: [run["summary"][f] for run in runs[p]] for f in ("hit_rate", "ttft_p50_s", "ttft_p95_s")}
                 for p in policies}
    print(f"{len(order)} rounds, policies in rotated order ({' | '.join(', '.join(o) for o in order)}); figures "
          f"pooled over rounds; per round [median, min, max]:")
    for p in policies:
        print(f"  {p:<14} hit rate " + ", ".join(f"{100 * v:.1f}%" for v in per_round[p]["hit_rate"])
              + "; TTFT p50 " + ", ".join(f"{v:.2f}" for v in per_round[p]["ttft_p50_s"]) + " s")
    for c in checks:
        print(f"  {'met   ' if c['met'] else 'MISSED'}  {c['target']}: {c['value']:.3f} vs {c['threshold']:.3f}"
              f" (met in {c['met_in_rounds']} rounds)"
              + ("  (above the ceiling: no router can meet it here)" if c["target"].startswith("hit rate")
                 and c["threshold"] > ceiling else ""))
    if problems:
        print(f"log lines with warnings/errors: {sum(len(v) for v in problems.values())} (see JSON 'log_problems')")
    print(f"cold caches: workers and gateway restarted per policy and round; took {total_s:.0f} s")

    by = lambda field: {p: getattr(s, field) for p, s in summaries.items()}  # noqa: E731
    report = {
        "quick": quick,
        "machine": machine,
        "config": {"model": MODEL, "policies": policies, "workers": NUM_WORKERS, "worker_threads": 1,
                   "kv_cache_bytes": args.kv_cache_bytes, "tenants": args.tenants, "conversations_per_tenant":
                   conversations, "turns": turns, "users": args.users, "max_tokens": args.max_tokens,
                   "temperature": 0, "system_words": args.system_words, "seed": args.seed,
                   "first_turn_prompt_tokens_mean": first_turn_tokens,
                   "prompt_tokens_mean": _mean([len(ids) for _, ids in prompts]),
                   "cold_caches": "workers and gateway restarted for each policy in each round",
                   "rounds": len(order), "order": order,
                   "assistant_messages": "scripted (a sentence of the tenant's document), not the model's reply",
                   "ttft": "client clock, request sent -> first chunk with content"},
        "hit_rate": by("hit_rate"),
        "hit_rate_workers": {p: d["hit_rate_workers"] for p, d in details.items()},
        "hit_rate_ceiling": ceiling,
        "hit_rate_by_turn": by("hit_rate_by_turn"),
        "ttft_p50_s": by("ttft_p50_s"),
        "ttft_p95_s": by("ttft_p95_s"),
        "latency_p50_s": by("latency_p50_s"),
        "requests_per_s": by("requests_per_s"),
        "output_tok_s": by("output_tok_s"),
        "requests_per_worker": by("requests_per_worker"),
        "computed_prompt_tokens_per_worker": by("computed_tokens_per_worker"),
        "max_over_mean_load": by("max_over_mean_load"),
        "max_over_mean_computed_tokens": by("max_over_mean_computed"),
        "same_worker_as_previous_turn": by("same_worker_rate"),
        "router_overlap_agreement": by("overlap_agreement"),
        "errors": by("errors"),
        "wall_s": by("wall_s"),
        "targets": checks,
        "per_round": per_round,
        "per_round_spread": {p: {f: spread(v) for f, v in figs.items()} for p, figs in per_round.items()},
        "headline": {**{f"hit_rate_{p}": summaries[p].hit_rate for p in policies},
                     **{f"ttft_p50_s_{p}": summaries[p].ttft_p50_s for p in policies}},
        "policy_runs": details,
        "log_problems": problems,
        "total_s": total_s,
    }
    path = write_report(args.json_path, report)
    png = path.with_suffix(".png")
    if _plot(summaries, png, f"routing policies, {NUM_WORKERS} workers on {machine['cpus_usable']} shared CPUs"):
        print(f"wrote {png}")
    return 0


def _print_table(summaries: dict[str, PolicySummary], details: dict[str, dict[str, Any]]) -> None:
    print(f"{'policy':<14}{'hit rate':>9}{'(workers)':>10}{'TTFT p50':>10}{'TTFT p95':>10}{'req/s':>7}"
          f"{'out tok/s':>10}  {'requests per worker':<22}{'max/mean':>9}{'same wkr':>9}{'errors':>7}")
    for p, s in summaries.items():
        loads = " ".join(f"{n:>3}" for n in s.requests_per_worker.values())
        print(f"{p:<14}{s.hit_rate:>9.1%}{details[p]['hit_rate_workers']:>10.1%}{s.ttft_p50_s:>9.2f}s"
              f"{s.ttft_p95_s:>9.2f}s{s.requests_per_s:>7.2f}{s.output_tok_s:>10.1f}  {loads:<22}"
              f"{s.max_over_mean_load:>9.2f}{s.same_worker_rate:>9.0%}{s.errors:>7}")


def _plot(summaries: dict[str, PolicySummary], path: Path, title: str) -> bool:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no PNG", file=sys.stderr)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summaries)
    colours = {"prefix": "tab:blue", "round-robin": "tab:orange", "least-loaded": "tab:green"}
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(14, 4.2))
    a.bar(names, [100 * summaries[p].hit_rate for p in names], color=[colours[p] for p in names])
    a.set_ylabel("prefix cache hit rate (% of prompt tokens)")
    xs = range(len(names))
    b.bar([x - 0.2 for x in xs], [summaries[p].ttft_p50_s for p in names], 0.4, label="p50", color="tab:gray")
    b.bar([x + 0.2 for x in xs], [summaries[p].ttft_p95_s for p in names], 0.4, label="p95", color="tab:red")
    b.set_xticks(list(xs), names)
    b.set_ylabel("TTFT (s)")
    b.legend()
    workers = list(next(iter(summaries.values())).requests_per_worker) if summaries else []
    width = 0.8 / max(1, len(names))
    for i, p in enumerate(names):
        c.bar([w + (i - (len(names) - 1) / 2) * width for w in range(len(workers))],
              [summaries[p].requests_per_worker[w] for w in workers], width, label=p, color=colours[p])
    c.set_xticks(range(len(workers)), workers)
    c.set_ylabel("requests per worker")
    c.legend()
    for ax in (a, b, c):
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
