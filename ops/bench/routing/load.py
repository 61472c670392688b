"""`edgeserve bench routing`'s load generator: closed loop, each user playing whole conversations turn
by turn through the gateway, streamed, reading the usage chunk and which worker served it."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

from gateway.generation import worker_tag
from ops.bench.routing.measures import TurnResult
from ops.bench.routing.workload import MODEL, Conversation, turn_messages

__all__ = ["send_turn", "drive"]


async def send_turn(client: Any, url: str, token: str, messages: list[dict[str, str]], max_tokens: int,
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
