"""`edgeserve bench routing`'s load generator: a closed loop of users playing the workload's turns through the
gateway, streamed, reading the usage chunk and which worker served it.

The order of turns (`play_turns`) is `interleaved` by default: a conversation's next turn joins the back of one
queue of ready turns once its previous turn has finished, and a free user takes the oldest ready turn. With more
conversations than users, a conversation's next turn then waits behind other conversations' turns, as a chat
user's next message comes after the reply has been read while others' requests keep arriving. `back-to-back`
(each user takes the next conversation and plays its turns one after another, no pause) gave `least-loaded` the
prefix policy's affinity by timing alone: the worker that has just answered a turn is the least loaded one the
moment that conversation's next turn arrives.
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.generation import worker_tag
from ops.bench.routing.measures import TurnResult
from ops.bench.routing.workload import MODEL, Conversation, turn_messages

__all__ = ["TURN_ORDERS", "send_turn", "play_turns", "drive"]

TURN_ORDERS = ("interleaved", "back-to-back")


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


async def play_turns(workload: list[Conversation], users: int, play: Callable[[Conversation, int], Awaitable[None]],
                     order: str = "interleaved") -> None:
    """Closed loop: `users` users await `play(conversation, k)` for every turn of `workload` once, a conversation's
    turns one after another, in `order` (`TURN_ORDERS`; the module docstring says what each means)."""
    if order == "back-to-back":
        pending = iter(workload)

        async def user() -> None:
            for conv in pending:
                for k in range(len(conv.turns)):
                    await play(conv, k)
    elif order == "interleaved":
        ready = collections.deque((conv, 0) for conv in workload if conv.turns)
        unfinished = sum(len(conv.turns) for conv in workload)
        changed = asyncio.Condition()

        async def user() -> None:
            nonlocal unfinished
            while True:
                async with changed:
                    await changed.wait_for(lambda: ready or not unfinished)
                    if not ready:
                        return
                    conv, k = ready.popleft()
                try:
                    await play(conv, k)
                finally:
                    async with changed:
                        unfinished -= 1
                        if k + 1 < len(conv.turns):
                            ready.append((conv, k + 1))
                        changed.notify_all()
    else:
        raise ValueError(f"unknown turn order {order!r}; choose from {TURN_ORDERS}")
    await asyncio.gather(*(user() for _ in range(users)))


async def drive(url: str, tokens: list[str], workload: list[Conversation], users: int, max_tokens: int,
                worker_ids: dict[str, str], log: Callable[[str], None],
                order: str = "interleaved") -> tuple[list[TurnResult], float, str]:
    """`play_turns` through the gateway at `url` (one HTTP client, a connection per user); (results, wall s, a
    sample reply)."""
    import httpx

    results: list[TurnResult] = []
    sample, finished = [""], [0]
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=httpx.Limits(max_connections=users)) as client:
        async def play(conv: Conversation, k: int) -> None:
            res, text = await send_turn(client, url, tokens[conv.tenant], turn_messages(conv, k), max_tokens,
                                        worker_ids, t0)
            res.tenant, res.conversation, res.turn = conv.tenant, conv.index, k
            results.append(res)
            sample[0] = sample[0] or text
            if res.error is not None:
                log(f"  error: tenant {conv.tenant} conversation {conv.index} turn {k}: {res.error}")
            if k + 1 == len(conv.turns):
                finished[0] += 1
                if finished[0] % 8 == 0:
                    log(f"  {finished[0]} / {len(workload)} conversations done")

        await play_turns(workload, users, play, order)
    return results, time.perf_counter() - t0, sample[0]
