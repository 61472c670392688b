"""The reasoning parser contract: model text in, `reasoning_content` and `content` out, incrementally.

    parser = Qwen3ReasoningParser(in_think=prompt_ends_in_think, tool_start="<tool_call>")
    for piece in deltas: events += parser.feed(piece)
    events += parser.finish()

Events are `ReasoningDelta(text)` (for `reasoning_content`) and `ContentDelta(text)` (for
`content`, through the tool-call parser when there is one). The rule, shared by every
family (`START` / `END` are `<think>` / `</think>`):

- The output is in a think block from its first token when the prompt already opened one
  (the chat template ended it with `<think>`: `in_think`), or when the family always starts
  there (`IMPLICIT_START`, DeepSeek-R1); a `START` written first (after whitespace) is dropped.
  Otherwise a `START` at the very beginning (after whitespace) opens the block, and output
  that begins any other way is all content.
- Reasoning ends at `END` (dropped, with the whitespace after it), or at the tool parser's
  start marker (`tool_start`) or the family's own call markers (`ENDS_AT`): models such as
  Kimi K2 start calling tools with no `</think>`. The marker and what follows go to content,
  so the tool parser reads the call and no call markup stays in `reasoning_content`.
- An output that ends (or is cut by `max_tokens`) inside the block is all reasoning.

Text that could be the beginning of a marker is held back until it is known either way,
so the split never depends on how the text was cut into deltas.
"""

from __future__ import annotations

from typing import NamedTuple

from gateway.tool_parsers.base import ContentDelta

__all__ = ["ReasoningDelta", "ReasoningEvent", "ReasoningParser", "split_reasoning"]


class ReasoningDelta(NamedTuple):
    text: str


ReasoningEvent = ReasoningDelta | ContentDelta


class ReasoningParser:
    """One response's think-block splitter (module doc); families set the class constants."""

    START = "<think>"
    END = "</think>"
    IMPLICIT_START = False  # the output always begins inside the think block
    ENDS_AT: tuple[str, ...] = ()  # markers that also end reasoning (tool calls without `END`)

    def __init__(self, in_think: bool = False, tool_start: str | None = None) -> None:
        self._state = "opening" if in_think or self.IMPLICIT_START else "start"
        self._stops = [m for m in (self.END, *self.ENDS_AT, tool_start or "") if m]
        self._buf = ""
        self._strip = False  # drop whitespace at the start of content (after `END`)

    @classmethod
    def markers(cls) -> tuple[str, ...]:
        """Every marker this rule reads (kept in the decoded text where they are special tokens)."""
        return (cls.START, cls.END, *cls.ENDS_AT)

    def feed(self, text: str) -> list[ReasoningEvent]:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> list[ReasoningEvent]:
        return self._run(final=True)

    def _run(self, final: bool) -> list[ReasoningEvent]:
        out: list[ReasoningEvent] = []
        while True:
            if self._state in ("start", "opening"):
                lead = self._buf.lstrip()
                if lead.startswith(self.START):
                    self._buf, self._state = lead[len(self.START):], "think"
                    continue
                if not final and self.START.startswith(lead):  # may still become START
                    return out
                self._state = "think" if self._state == "opening" else "content"
                continue
            if self._state == "think":
                hits = [(i, m) for m in self._stops if (i := self._buf.find(m)) >= 0]
                if hits:
                    i, marker = min(hits)
                    out += _reasoning(self._buf[:i])
                    if marker == self.END:
                        self._buf, self._strip = self._buf[i + len(marker):], True
                    else:  # a tool call begins: it is content, for the tool parser
                        self._buf = self._buf[i:]
                    self._state = "content"
                    continue
                keep = 0 if final else max(_partial_suffix(self._buf, m) for m in self._stops)
                out += _reasoning(self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                return out
            if self._strip:
                self._buf = self._buf.lstrip()
                if not self._buf:
                    return out
                self._strip = False
            if self._buf:
                out.append(ContentDelta(self._buf))
            self._buf = ""
            return out


def split_reasoning(parser: ReasoningParser, text: str) -> tuple[str, str]:
    """`(reasoning_content, content)` of a whole output (non-streamed responses)."""
    reasoning, content = [], []
    for ev in [*parser.feed(text), *parser.finish()]:
        (reasoning if isinstance(ev, ReasoningDelta) else content).append(ev.text)
    return "".join(reasoning), "".join(content)


def _reasoning(text: str) -> list[ReasoningEvent]:
    return [ReasoningDelta(text)] if text else []


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
