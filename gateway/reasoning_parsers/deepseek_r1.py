"""DeepSeek-R1 (and its distills): the output always begins inside the think block (newer templates
end the prompt with `<think>\n`, older models write it themselves), so everything before `</think>`
is reasoning, and an output with no `</think>` is all reasoning. Never chosen from a config: the
same architecture (DeepseekV3) also serves models that do not reason."""

from __future__ import annotations

from gateway.reasoning_parsers.base import ReasoningParser

__all__ = ["DeepSeekR1ReasoningParser"]


class DeepSeekR1ReasoningParser(ReasoningParser):
    IMPLICIT_START = True
