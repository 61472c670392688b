"""`edgeserve bench routing`'s measures: per request what the gateway and the worker said, and per
policy the hit rate, TTFT, load spread, stickiness and the prefix index's agreement with the caches;
the prefix policy's targets, and the rotated order policies run in."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from ops.bench.harness.stats import percentile, rotated

__all__ = ["TurnResult", "PolicySummary", "hit_rate", "max_over_mean", "ceiling_hit_rate", "same_worker_rate",
           "overlap_agreement", "summarize", "check_targets", "round_order", "targets_by_round"]


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
