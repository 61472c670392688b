"""Qwen3: `<think>...</think>` at the start of the output, or already opened by the template
(`enable_thinking`); a template that closed an empty block itself (`<think>\n\n</think>`, thinking
off) leaves the output as content. Output that does not begin with `<think>` is content."""

from __future__ import annotations

from gateway.reasoning_parsers.base import ReasoningParser

__all__ = ["Qwen3ReasoningParser"]


class Qwen3ReasoningParser(ReasoningParser):
    pass
