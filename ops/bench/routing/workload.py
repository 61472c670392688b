"""`edgeserve bench routing`'s workload: tenants with their own system prompts (a Brown-corpus document
each), multi-turn conversations with scripted answers, in a seeded shuffled order, and the prompt ids
the gateway renders for them (for the hit-rate ceiling)."""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import NamedTuple

__all__ = ["MODEL", "Conversation", "make_workload", "turn_messages", "brown_documents", "turn_keys",
           "workload_prompt_ids"]

MODEL = "smollm2-135m"


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


def turn_keys(workload: list[Conversation]) -> list[tuple[Conversation, int]]:
    """(conversation, turn) of every request, in workload order."""
    return [(conv, k) for conv in workload for k in range(len(conv.turns))]


def workload_prompt_ids(workload: list[Conversation]) -> list[tuple[int, list[int]]]:
    """(tenant, prompt token ids) of every request in workload order, as the gateway renders them."""
    from gateway.config import ModelRoute
    from gateway.served_models import ServedModel
    from ops.pull import resolve_model

    model = ServedModel(ModelRoute(name=MODEL, model_dir=str(resolve_model(MODEL))))
    return [(conv.tenant, model.chat_prompt_ids(turn_messages(conv, k))) for conv, k in turn_keys(workload)]
