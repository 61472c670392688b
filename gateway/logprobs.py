"""Worker logprobs (`backend.protocol.Logprobs`) in OpenAI's two response shapes.

Chat (`choices[].logprobs.content`): one entry per generated token,
    {"token": str, "logprob": float, "bytes": [int], "top_logprobs": [{"token", "logprob", "bytes"}]}
Completions (legacy, `choices[].logprobs`): parallel lists
    {"tokens": [str], "token_logprobs": [float | None], "top_logprobs": [{str: float} | None],
     "text_offset": [int]}
where, with `echo`, the prompt's tokens come first and the first prompt token's
logprob and alternatives are null (nothing precedes it), as OpenAI answers.

A token's string is its own decoding (a byte-level piece that is part of a UTF-8
character decodes to U+FFFD; `bytes` in chat carries the UTF-8 of that string).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from backend.protocol import Logprobs
from backend.tokenizer import Tokenizer

__all__ = ["chat_logprobs", "completion_logprobs", "join_completion_logprobs", "token_text"]


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    """One token's text as scoring clients see it (special tokens spelled out)."""
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def chat_logprobs(tokenizer: Tokenizer, token_ids: Sequence[int], lp: Logprobs) -> list[dict[str, Any]]:
    """`logprobs.content` of a chat choice or chunk for these generated tokens."""
    out = []
    for i, (tok, value) in enumerate(zip(token_ids, lp.token)):
        entry = _entry(token_text(tokenizer, tok), value)
        alts = zip(lp.top_ids[i], lp.top_logprobs[i]) if lp.top_ids else ()
        entry["top_logprobs"] = [_entry(token_text(tokenizer, a), v) for a, v in alts]
        out.append(entry)
    return out


def completion_logprobs(tokenizer: Tokenizer, token_ids: Sequence[int], lp: Logprobs, *, first_is_null: bool = False,
                        text_offset: int = 0) -> dict[str, Any]:
    """A completions `logprobs` object for `token_ids`; `lp` covers all of them, or all but the first when
    `first_is_null` (an echoed prompt: its first token gets null logprob and alternatives)."""
    tokens = [token_text(tokenizer, t) for t in token_ids]
    values: list[float | None] = [None] * first_is_null + list(lp.token)
    tops: list[dict[str, float] | None] = [None] * first_is_null
    for i in range(len(lp.token)):
        alts = zip(lp.top_ids[i], lp.top_logprobs[i]) if lp.top_ids else ()
        top: dict[str, float] = {}
        for a, v in alts:
            top.setdefault(token_text(tokenizer, a), v)  # two ids may spell the same text: keep the likelier
        top.setdefault(tokens[i + first_is_null], lp.token[i])  # the chosen token is always there, as OpenAI does
        tops.append(top)
    offsets = []
    for t in tokens:
        offsets.append(text_offset)
        text_offset += len(t)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def join_completion_logprobs(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two consecutive completions `logprobs` objects (an echoed prompt's, then the completion's) as one."""
    return {k: a[k] + b[k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
