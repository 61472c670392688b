"""GLM-4.5 / 4.6 / 4.7: `<think>...</think>` before the answer (GLM-4.7's template may open it in
the prompt; `/nothink` gives an empty block). Tool calls (`<tool_call>`) may follow the reasoning
with no `</think>`: the tool parser's start marker ends it."""

from __future__ import annotations

from gateway.reasoning_parsers.base import ReasoningParser

__all__ = ["Glm45ReasoningParser"]


class Glm45ReasoningParser(ReasoningParser):
    pass
