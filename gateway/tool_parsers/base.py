"""The tool-call parser contract: model text in, content and tool calls out, incrementally.

    parser = HermesParser()                    # one per response
    for piece in deltas: events += parser.feed(piece)
    events += parser.finish()                  # end of output: what is still held back

Events are `ContentDelta(text)` (plain text for `content`) and `ToolCallDelta(index, id,
name, arguments)`: a call's first delta carries its id and name (arguments ""), the
following ones carry argument fragments, as OpenAI streams them. A call is released
once its closing marker arrives (or at `finish`, if its body parses without one), so
the parse never depends on where the text was cut into deltas: only how the content
text is split can differ. Text that might begin a start marker is held back until it
is known either way.

Malformed output is never an error: a block that does not parse is given back as
plain content, verbatim. Whitespace between a call and what follows is dropped.

`MarkerParser` implements this for formats that wrap calls between a start and an end
marker; each family only says how one block's body reads (`parse_block`).
"""

from __future__ import annotations

import uuid
from typing import Any, NamedTuple

__all__ = ["ContentDelta", "ToolCallDelta", "ParsedCall", "ParseEvent", "ToolParser", "MarkerParser",
           "new_call_id"]


class ContentDelta(NamedTuple):
    text: str


class ToolCallDelta(NamedTuple):
    index: int
    id: str | None = None  # first delta of a call only
    name: str | None = None  # first delta of a call only
    arguments: str = ""  # a fragment of the JSON string


class ParsedCall(NamedTuple):
    name: str
    arguments: str  # JSON text of an object
    id: str | None = None  # the model's own id (Kimi K2), else one is made


ParseEvent = ContentDelta | ToolCallDelta


def new_call_id() -> str:
    """An OpenAI-style tool call id: `call_` and 24 hex digits."""
    return "call_" + uuid.uuid4().hex[:24]


class ToolParser:
    """Base of every family's parser: `feed` text, `finish` at the end; `calls` counts calls released."""

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = tools or []
        self.calls = 0

    def feed(self, text: str) -> list[ParseEvent]:
        raise NotImplementedError

    def finish(self) -> list[ParseEvent]:
        raise NotImplementedError

    def param_type(self, function: str, key: str) -> str | None:
        """The JSON-schema `type` the request's tool `function` gives parameter `key` (None if unknown)."""
        for tool in self.tools:
            fn = tool.get("function") or {}
            if fn.get("name") == function:
                prop = ((fn.get("parameters") or {}).get("properties") or {}).get(key) or {}
                kind = prop.get("type")
                return kind if isinstance(kind, str) else None
        return None


def collect(events: list[ParseEvent]) -> tuple[str, list[ParsedCall]]:
    """Join events into content text and complete calls."""
    content: list[str] = []
    calls: dict[int, list[str]] = {}
    for ev in events:
        if isinstance(ev, ContentDelta):
            content.append(ev.text)
        elif ev.id is not None:
            calls[ev.index] = [ev.id, ev.name or "", ev.arguments]
        else:
            calls[ev.index][2] += ev.arguments
    return "".join(content), [ParsedCall(n, a, i) for i, n, a in (calls[k] for k in sorted(calls))]


class MarkerParser(ToolParser):
    """Calls between `START` and `END` markers; `parse_block(body)` reads one block's calls
    (None: malformed, the block stays text). `END` may be absent at the end of the output."""

    START = ""
    END = ""

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._buf = ""  # text not yet released
        self._in_block = False
        self._after_call = False  # drop whitespace right after a call

    def parse_block(self, body: str) -> list[ParsedCall] | None:
        raise NotImplementedError

    def feed(self, text: str) -> list[ParseEvent]:
        self._buf += text
        out: list[ParseEvent] = []
        while True:
            if self._in_block:
                end = self._buf.find(self.END)
                if end < 0:
                    return out
                body, self._buf = self._buf[:end], self._buf[end + len(self.END):]
                self._in_block = False
                out += self._block(body, closed=True)
                continue
            start = self._buf.find(self.START)
            if start >= 0:
                out += self._content(self._buf[:start])
                self._buf = self._buf[start + len(self.START):]
                self._in_block = True
                continue
            keep = _partial_suffix(self._buf, self.START)
            out += self._content(self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return out

    def finish(self) -> list[ParseEvent]:
        buf, self._buf = self._buf, ""
        if self._in_block:
            self._in_block = False
            return self._block(buf, closed=False)
        return self._content(buf)

    def _content(self, text: str) -> list[ParseEvent]:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return []
            self._after_call = False
        return [ContentDelta(text)] if text else []

    def _block(self, body: str, closed: bool) -> list[ParseEvent]:
        try:
            calls = self.parse_block(body)
        except (ValueError, TypeError, KeyError, AttributeError):
            calls = None
        if not calls:
            return self._content(self.START + body + (self.END if closed else ""))
        out: list[ParseEvent] = []
        for call in calls:
            out.append(ToolCallDelta(self.calls, call.id or new_call_id(), call.name, ""))
            out.append(ToolCallDelta(self.calls, arguments=call.arguments))
            self.calls += 1
        self._after_call = True
        return out


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
