"""Prompt tokenisation in the gateway: chat prompts encoded whole against piece by piece with the `PieceCache`.

The gateway turns every chat request into token ids (`Tokenizer.encode_chat`) on its own event
loop, or a thread of its process, before anything else happens to it. Three workloads, each
encoded both ways with the model's tokenizer (default SmolLM2-135M), call by call, the first of
the two alternating:

- ``conversation``: one chat of ``--turns`` messages (default 24; quick 12) of 60-140 words, user
  and assistant in turn after a system prompt, encoded as a client sends it, turn after turn
  (each request is the whole conversation so far and the generation prompt). Cached: each
  repetition replays the conversation in a namespace of its own, so at turn t the cache holds
  exactly what that conversation's earlier requests left, as in a gateway;
- ``single``: one-turn requests, a shared system prompt and a new 40-word user message each;
- ``repeat``: one request sent again and again (what `bench gateway` sends: every piece a hit).

Per workload: the median ms of a request both ways and whole / cached; for the conversation
also at its last turn (the longest prompt), with its tokens. Ids are compared on every call: a
difference stops the run.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time
from typing import Any

from ops.bench.report import write_report

__all__ = ["add_arguments", "run", "conversation"]

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches at night "
         "under 12 stars, 3.5 moons and one café; naïve übung 👋 \"quoted\" (parenthesised) code_like x=1").split()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="model folder or name (its tokenizer)")
    p.add_argument("--turns", type=int, default=None, help="messages in the conversation (default 24; quick 12)")
    p.add_argument("--repeats", type=int, default=None, help="repetitions of each workload (default 10; quick 3)")


def _message(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def conversation(turns: int, seed: int = 0) -> list[dict[str, str]]:
    """A system prompt and `turns` messages, user and assistant in turn."""
    rng = random.Random(seed)
    messages = [{"role": "system", "content": "You are a helpful assistant. " + _message(rng, 30, 30)}]
    for t in range(turns):
        messages.append({"role": "user" if t % 2 == 0 else "assistant", "content": _message(rng, 60, 140)})
    return messages


def _both(tokenizer: Any, messages: list[dict[str, str]], namespace: str, times: dict[str, list[float]],
          cached_first: bool) -> int:
    """Encode `messages` whole and cached, in the order `cached_first` says, timing each into `times`; the ids must
    agree. Returns their count."""
    got = {}
    for way in (("cached", "whole") if cached_first else ("whole", "cached")):
        t0 = time.perf_counter()
        got[way] = tokenizer.encode_chat(messages, cache_namespace=namespace if way == "cached" else None)
        times[way].append(time.perf_counter() - t0)
    if got["whole"] != got["cached"]:
        raise AssertionError(f"piece-by-piece ids differ from the whole prompt's ({len(messages)} messages)")
    return len(got["whole"])


def _summary(times: dict[str, list[float]]) -> dict[str, float]:
    whole, cached = statistics.median(times["whole"]) * 1e3, statistics.median(times["cached"]) * 1e3
    return {"whole_ms": whole, "cached_ms": cached, "whole_over_cached": whole / cached}


def run(args: argparse.Namespace) -> int:
    from backend.tokenizer import Tokenizer
    from ops.pull import resolve_model

    tokenizer = Tokenizer.from_model_dir(resolve_model(args.model, progress=False))
    if tokenizer.piece_cache is None:
        why = "its tokenizer encodes whole (no PieceCache for its pipeline)"
        print(f"{args.model}: {why}; nothing to compare")
        write_report(args.json_path, {"model": args.model, "skipped": {"all": why}})
        return 0
    turns = args.turns or (12 if args.quick else 24)
    repeats = args.repeats or (3 if args.quick else 10)
    chat = conversation(turns)
    tokenizer.encode_chat(chat)  # template compiled, pools warm
    results: dict[str, Any] = {}

    calls = itertools.count()  # the first mover alternates call by call
    times: dict[str, list[float]] = {"whole": [], "cached": []}
    last: dict[str, list[float]] = {"whole": [], "cached": []}
    tokens = 0
    for r in range(repeats):
        for t in range(1, turns + 1):
            tokens = _both(tokenizer, chat[:t + 1], f"conversation-{r}", times, next(calls) % 2 == 1)
        for way in last:
            last[way].append(times[way][-1])
    results["conversation"] = {**_summary(times), "turns": turns, "last_turn": {**_summary(last), "tokens": tokens}}

    rng = random.Random(1)
    system = {"role": "system", "content": "You are a helpful assistant. " + _message(rng, 30, 30)}
    times = {"whole": [], "cached": []}
    for _ in range(repeats * 20):
        _both(tokenizer, [system, {"role": "user", "content": _message(rng, 40, 40)}], "single", times,
              next(calls) % 2 == 1)
    results["single"] = _summary(times)

    same = [{"role": "user", "content": "Say hello to the world."}]
    times = {"whole": [], "cached": []}
    for _ in range(repeats * 20):
        _both(tokenizer, same, "repeat", times, next(calls) % 2 == 1)
    results["repeat"] = _summary(times)

    print(f"{'workload':<34} {'whole ms':>9} {'cached ms':>10} {'whole/cached':>13}")
    rows = [(f"conversation, every turn (1..{turns})", results["conversation"]),
            (f"conversation, turn {turns} ({tokens} tokens)", results["conversation"]["last_turn"]),
            ("single turn, new message", results["single"]), ("the same request again", results["repeat"])]
    for name, row in rows:
        print(f"{name:<34} {row['whole_ms']:>9.3f} {row['cached_ms']:>10.3f} {row['whole_over_cached']:>12.2f}x")
    headline = {"conversation_last_turn_x": results["conversation"]["last_turn"]["whole_over_cached"],
                "single_turn_x": results["single"]["whole_over_cached"],
                "repeat_x": results["repeat"]["whole_over_cached"]}
    write_report(args.json_path, {"model": args.model, "repeats": repeats, **results, "headline": headline})
    return 0
