"""A chat response's text, split the way OpenAI clients read it: reasoning, content and tool calls.

    out = ChatOutput(reasoning=parser_or_None, tools=tool_parser_or_None)
    for d in text_deltas: deltas += out.feed(d)      # OpenAI chunk `delta`s
    deltas += out.finish()
    message = chat_message(reasoning, tools, whole_text)   # non-streamed `message`

The reasoning parser (`reasoning_parsers/`) takes the text first: think-block text becomes
`reasoning_content` (its own delta field, streamed as it arrives), the rest goes on as
content. With tools in play, that content then goes through the tool-call parser
(`tool_parsers/`), which turns calls into `tool_calls` (index, id, type and name first,
then argument fragments) and leaves the rest as `content`. So call markup never lands in
`reasoning_content` or `content`, and a call right after reasoning with no `</think>` is
still a call. Without either parser the text is `content` as generated.
"""

from __future__ import annotations

from typing import Any

from gateway.reasoning_parsers import ReasoningDelta, ReasoningParser, split_reasoning
from gateway.tool_parsers import ContentDelta, ToolParser
from gateway.tool_parsers.base import collect
from gateway.tools import ToolCallStream

__all__ = ["ChatOutput", "chat_message"]


class ChatOutput:
    """Streamed text → OpenAI chunk deltas (`{"reasoning_content": ...}`, `{"content": ...}`,
    `{"tool_calls": [...]}`), through the request's reasoning and tool parsers."""

    def __init__(self, reasoning: ReasoningParser | None = None, tools: ToolParser | None = None) -> None:
        self.reasoning = reasoning
        self.calls = ToolCallStream(tools) if tools is not None else None

    def feed(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        if self.reasoning is None:
            return self._content(text)
        return self._route(self.reasoning.feed(text))

    def finish(self) -> list[dict[str, Any]]:
        out = self._route(self.reasoning.finish()) if self.reasoning is not None else []
        if self.calls is not None:
            out += self.calls.finish()
        return out

    @property
    def called(self) -> bool:
        """Whether a tool call has been sent."""
        return self.calls is not None and self.calls.called

    def _route(self, events: list[ReasoningDelta | ContentDelta]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for ev in events:
            if isinstance(ev, ReasoningDelta):
                out.append({"reasoning_content": ev.text})
            else:
                out += self._content(ev.text)
        return out

    def _content(self, text: str) -> list[dict[str, Any]]:
        return self.calls.feed(text) if self.calls is not None else [{"content": text}]


def chat_message(reasoning: ReasoningParser | None, tools: ToolParser | None, text: str) -> dict[str, Any]:
    """The non-streamed assistant `message` for the whole output `text`: `content`, and
    `reasoning_content` when a reasoning parser is on (None without a think block), `tool_calls`
    when the tool parser read complete calls (content then None if empty)."""
    message: dict[str, Any] = {"role": "assistant"}
    content = text
    if reasoning is not None:
        thought, content = split_reasoning(reasoning, text)
        message["reasoning_content"] = thought or None
    if tools is None:
        message["content"] = content
        return message
    content, calls = collect(tools.parse_whole(content))
    if not calls:
        message["content"] = content
        return message
    message["content"] = content or None
    message["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in calls]
    return message
