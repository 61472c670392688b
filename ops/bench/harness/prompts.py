"""Prompts the engine benchmarks share: chat-templated essays of an exact length, instructions about a
list of topics, and synthetic token ids from seeded generators (no tokenizer; the model's text
quality plays no part)."""

from __future__ import annotations

import random
from typing import Any

__all__ = ["TOPICS", "INSTRUCTIONS", "fixed_length_prompts", "greedy_prompts", "random_prompts", "random_ids"]

TOPICS = ["the sea", "a city at night", "learning to cook", "the history of maps", "a long train journey",
          "why the sky is blue", "a friendly robot", "how bridges stand up", "autumn leaves", "the first computer",
          "a mountain village", "sleep and dreams", "volcanoes", "a lost umbrella", "chess openings", "bees"]
INSTRUCTIONS = ["Write a short essay about {}.", "Explain {} to a ten-year-old.",
                "List three surprising facts about {}."]


def fixed_length_prompts(tok: Any, count: int, length: int) -> list[list[int]]:
    """`count` chat-templated prompts of exactly `length` tokens: a long user message cut to
    fit, so each keeps the template's head and its generation prompt."""
    prompts = []
    for i in range(count):
        content = f"Write a short essay about {TOPICS[i % len(TOPICS)]}." + " Please be detailed and give examples." * (
            length // 6 + 1)
        rendered = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        at = rendered.index(content)
        head, body, tail = (tok.encode(rendered[:at]), tok.encode(content), tok.encode(rendered[at + len(content):]))
        room = length - len(head) - len(tail)
        if room < 8:
            raise ValueError(f"prompt length {length} leaves no room for a message (template takes "
                             f"{len(head) + len(tail)} tokens)")
        prompts.append(head + body[:room] + tail)
    return prompts


def greedy_prompts(tok: Any, count: int) -> list[list[int]]:
    """`count` chat-templated instructions about `TOPICS`, each its own length."""
    prompts = []
    for i in range(count):
        text = INSTRUCTIONS[(i // len(TOPICS)) % len(INSTRUCTIONS)].format(TOPICS[i % len(TOPICS)])
        prompts.append(tok.encode(tok.apply_chat_template([{"role": "user", "content": text}],
                                                          add_generation_prompt=True)))
    return prompts


def random_prompts(vocab: int, count: int, length: int, seed: int = 0) -> list[list[int]]:
    """`count` prompts of `length` token ids drawn uniformly from [3, vocab) (ids 0-2 are the specials)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count, length), generator=gen).tolist()


def random_ids(rng: random.Random, n: int) -> list[int]:
    """`n` token ids uniform in [100, 40000) from `rng`."""
    return [rng.randrange(100, 40000) for _ in range(n)]
