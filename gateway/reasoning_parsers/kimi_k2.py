"""Kimi K2 (Thinking, K2.5/K2.6): `<think>...</think>`; the model sometimes opens its tool-call
section (`<|tool_calls_section_begin|>`, a special token kept in the text for the parsers) with no
`</think>`, which ends the reasoning even when the request's tool parser is another one."""

from __future__ import annotations

from gateway.reasoning_parsers.base import ReasoningParser

__all__ = ["KimiK2ReasoningParser"]


class KimiK2ReasoningParser(ReasoningParser):
    ENDS_AT = ("<|tool_calls_section_begin|>",)
