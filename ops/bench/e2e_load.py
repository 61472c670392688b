"""The load both systems get in `edgeserve bench e2e`: prompts unique to a pass, one closed-loop client
through `POST /v1/chat/completions`, and the per-pass rows, ratios and spreads computed from it.

c users, each with its own HTTP connection, send non-streamed requests back to back until the
pass's prompts are answered; output tokens/s = the responses' `usage.completion_tokens` summed over
the pass's wall time. llama-server's responses also carry its own decode time per token
(`timings.predicted_per_token_ms`), kept per reply.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = ["MODEL", "SYSTEMS", "make_prompts", "chat_body", "PassRow", "closed_loop", "pass_row", "pass_order",
           "mean_tok_s", "ratios", "spreads"]

MODEL = "smollm2-135m"
SYSTEMS = ("edgeserve", "llamacpp")

_SUBJECTS = ("a lighthouse keeper", "a young baker", "an old clockmaker", "a travelling musician", "a retired pilot",
             "a curious fox", "a ship's cook", "a village teacher", "a mountain guide", "a street painter")
_EVENTS = ("finds a sealed letter", "loses a precious key", "meets a stranger at dawn", "hears a strange song",
           "discovers a hidden door", "receives an unexpected gift", "gets caught in a storm", "wins a contest")
_PLACES = ("a small harbour town", "a snowy valley", "a busy market", "an abandoned railway station",
           "a desert oasis", "a quiet forest", "a floating city", "an island of windmills")
_DETAILS = ("weather", "smells", "sounds", "colours", "people nearby", "food", "buildings", "animals", "light")


def make_prompts(tag: str, n: int) -> list[str]:
    """`n` user messages of ~50 tokens (~80 with SmolLM2's chat template), each opening with `tag` and
    its index, so no two share more than the template's prefix; seeded by `tag`."""
    rng = random.Random(tag)
    out = []
    for i in range(n):
        a, b, c = rng.sample(_DETAILS, 3)
        out.append(f"Story {tag}-{i}. Write a long story about {rng.choice(_SUBJECTS)} who "
                   f"{rng.choice(_EVENTS)} in {rng.choice(_PLACES)}. Describe the {a}, the {b} and the {c}.")
    return out


def chat_body(prompt: str, max_tokens: int) -> dict[str, Any]:
    """The request both systems get: one user message, greedy, not streamed."""
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0.0, "stream": False}


@dataclass
class PassRow:
    """One system's pass at one format class and concurrency."""

    system: str
    fmt: str
    concurrency: int
    pass_index: int
    position: int  # 0: this system went first in the pass
    requests: int
    errors: int
    completion_tokens: int
    wall_s: float
    tok_s: float
    mean_prompt_tokens: float
    mean_completion_tokens: float
    in_process_ms_per_token: float | None  # llama.cpp: its responses' timings (mean); edgeserve: None here
    error_kinds: dict[str, int]


class _Reply(NamedTuple):
    prompt_tokens: int
    completion_tokens: int
    ms_per_token: float | None  # llama-server's `timings.predicted_per_token_ms`


async def closed_loop(url: str, headers: dict[str, str], prompts: list[str], concurrency: int,
                      max_tokens: int) -> tuple[list[_Reply], dict[str, int], float]:
    """`concurrency` users (one connection each) take the next prompt until none is left; returns
    (the replies, errors by kind, wall seconds)."""
    import httpx

    queue = list(reversed(prompts))
    replies: list[_Reply] = []
    errors: dict[str, int] = {}

    async def user(client: httpx.AsyncClient) -> None:
        while queue:
            prompt = queue.pop()
            try:
                resp = await client.post(url, json=chat_body(prompt, max_tokens), headers=headers)
            except httpx.HTTPError as exc:
                errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                continue
            if resp.status_code != 200:
                errors[f"HTTP {resp.status_code}"] = errors.get(f"HTTP {resp.status_code}", 0) + 1
                continue
            body = resp.json()
            usage, timings = body["usage"], body.get("timings") or {}
            replies.append(_Reply(usage["prompt_tokens"], usage["completion_tokens"],
                                  timings.get("predicted_per_token_ms")))

    clients = [httpx.AsyncClient(timeout=httpx.Timeout(600.0)) for _ in range(concurrency)]
    try:
        start = time.perf_counter()
        await asyncio.gather(*(user(c) for c in clients))
        wall = time.perf_counter() - start
    finally:
        for c in clients:
            await c.aclose()
    return replies, errors, wall


def pass_row(system: str, fmt: str, c: int, index: int, position: int, replies: list[_Reply],
             errors: dict[str, int], wall_s: float) -> PassRow:
    tokens = sum(r.completion_tokens for r in replies)
    per_token = [r.ms_per_token for r in replies if r.ms_per_token is not None]
    mean = lambda xs: statistics.fmean(xs) if xs else float("nan")  # noqa: E731
    return PassRow(system, fmt, c, index, position, len(replies), sum(errors.values()), tokens, wall_s,
                   tokens / wall_s if wall_s > 0 else 0.0, mean([r.prompt_tokens for r in replies]),
                   mean([r.completion_tokens for r in replies]), statistics.fmean(per_token) if per_token else None,
                   errors)


def pass_order(index: int, c_index: int) -> tuple[str, str]:
    """Which system goes first: alternating by pass, and shifted by concurrency level."""
    return SYSTEMS if (index + c_index) % 2 == 0 else SYSTEMS[::-1]


def mean_tok_s(rows: list[PassRow], system: str, fmt: str, c: int) -> float | None:
    vals = [r.tok_s for r in rows if (r.system, r.fmt, r.concurrency) == (system, fmt, c)]
    return statistics.fmean(vals) if vals else None


def ratios(rows: list[PassRow]) -> dict[str, dict[int, float | None]]:
    """format -> c -> edgeserve tok/s over llama.cpp tok/s (each the mean over its passes)."""
    out: dict[str, dict[int, float | None]] = {}
    for fmt, c in dict.fromkeys((r.fmt, r.concurrency) for r in rows):
        ours, theirs = mean_tok_s(rows, "edgeserve", fmt, c), mean_tok_s(rows, "llamacpp", fmt, c)
        out.setdefault(fmt, {})[c] = ours / theirs if ours is not None and theirs else None
    return out


def spreads(rows: list[PassRow]) -> dict[str, dict[str, dict[int, float]]]:
    """system -> format -> c -> (max - min) / mean of the passes' tok/s."""
    out: dict[str, dict[str, dict[int, float]]] = {}
    for system, fmt, c in dict.fromkeys((r.system, r.fmt, r.concurrency) for r in rows):
        vals = [r.tok_s for r in rows if (r.system, r.fmt, r.concurrency) == (system, fmt, c)]
        mean = statistics.fmean(vals)
        out.setdefault(system, {}).setdefault(fmt, {})[c] = (max(vals) - min(vals)) / mean if mean else float("nan")
    return out
