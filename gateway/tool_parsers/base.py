"""The tool-call parser contract: model text in, content and tool calls out, incrementally.

    parser = HermesParser(tools)               # one per response
    for piece in deltas: events += parser.feed(piece)
    events += parser.finish()                  # end of output: what is still held back

Events are `ContentDelta(text)` (plain text for `content`) and `ToolCallDelta(index, id,
name, arguments)`: a call's first delta carries its id and name (arguments ""), the
following ones carry argument fragments, as OpenAI streams them. Arguments flow as the
tokens arrive: a family's `read_block(body, closed)` reads a block's calls as far as the
text goes, each call's `arguments` only ever growing, and the parser sends what grew.
The joined fragments are a call's final arguments (JSON text of an object). Text that
might begin a start marker is held back until it is known either way.

Malformed output is never an error. A block found malformed before any of its calls was
sent is given back as plain content, verbatim; that is always the case when the whole
text is fed at once (`tool_message`, non-streamed). Streamed, a call whose block turns out
malformed after its first fragment went out stays as sent (as OpenAI's and vLLM's streams
do) and the rest of that block is dropped; a call cut by `max_tokens` keeps the arguments
that arrived (`finish_reason` "length" says so). Whitespace between a call and what
follows is dropped.

`MarkerParser` implements this for formats that wrap calls between a start and an end
marker. Each family says how one block's body reads (`read_block`) and, for `tool_choice`
"required" or a named function, how its calls are written as a Lark grammar for
llguidance (`call_grammar`, `calls_grammar`; `gateway/tool_grammar.py` assembles them).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = ["ContentDelta", "ToolCallDelta", "ParsedCall", "ParseEvent", "ToolParser", "MarkerParser",
           "new_call_id", "scan_json_object", "arguments_begun", "Lit"]

Lit = Callable[[str], str]  # a marker as a Lark grammar item: `<marker>` for a special token, else a string


class ContentDelta(NamedTuple):
    text: str


class ToolCallDelta(NamedTuple):
    index: int
    id: str | None = None  # first delta of a call only
    name: str | None = None  # first delta of a call only
    arguments: str = ""  # a fragment of the JSON string


class ParsedCall(NamedTuple):
    name: str
    arguments: str  # JSON text of an object (while `complete` is False: its beginning)
    id: str | None = None  # the model's own id (Kimi K2), else one is made
    complete: bool = True


ParseEvent = ContentDelta | ToolCallDelta


def new_call_id() -> str:
    """An OpenAI-style tool call id: `call_` and 24 hex digits."""
    return "call_" + uuid.uuid4().hex[:24]


class ToolParser:
    """Base of every family's parser: `feed` text, `finish` at the end; `calls` counts calls started."""

    MARKERS: tuple[str, ...] = ()  # every marker the format spells (kept in the text if they are special tokens)

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = tools or []
        self.calls = 0

    def feed(self, text: str) -> list[ParseEvent]:
        raise NotImplementedError

    def finish(self) -> list[ParseEvent]:
        raise NotImplementedError

    def parse_whole(self, text: str) -> list[ParseEvent]:
        """Events for a whole output at once (non-streamed): a block that does not read as complete
        calls is content, never a partial call."""
        return [*self.feed(text), *self.finish()]

    def param_type(self, function: str, key: str) -> str | None:
        """The JSON-schema `type` the request's tool `function` gives parameter `key` (None if unknown)."""
        for tool in self.tools:
            fn = tool.get("function") or {}
            if fn.get("name") == function:
                prop = ((fn.get("parameters") or {}).get("properties") or {}).get(key) or {}
                kind = prop.get("type")
                return kind if isinstance(kind, str) else None
        return None

    # -- grammar (tool_choice "required" / named), see gateway/tool_grammar.py --------------------------
    @classmethod
    def call_grammar(cls, name: str, parameters: dict[str, Any], rule: str, lit: Lit) -> list[str]:
        """Lark rules defining `rule`: one call of function `name` whose arguments validate against
        `parameters`. Raises InvalidSamplingParams when the format cannot enforce that schema."""
        raise NotImplementedError

    @classmethod
    def calls_grammar(cls, call: str, many: bool, lit: Lit) -> str:
        """A Lark expansion for the whole tool-call output: one `call` (or, with `many`, one or more)."""
        raise NotImplementedError


def collect(events: list[ParseEvent]) -> tuple[str, list[ParsedCall]]:
    """Join events into content text and calls."""
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
    """Calls between `START` and `END` markers; `read_block(body, closed)` reads one block's calls
    (None: malformed). `END` may be absent at the end of the output (the block then closes there)."""

    START = ""
    END = ""

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._buf = ""  # text not yet released (in a block: the block's body so far)
        self._in_block = False
        self._sent: list[tuple[int, str]] = []  # this block's calls sent so far: (index, arguments sent)
        self._after_call = False  # drop whitespace right after a call
        self._incremental = True  # send calls while their block is still open

    def parse_whole(self, text: str) -> list[ParseEvent]:
        self._incremental = False
        return super().parse_whole(text)

    def read_block(self, body: str, closed: bool) -> list[ParsedCall] | None:
        """The calls in a block's `body` (`closed`: the whole body; else its beginning so far, where a
        call may be incomplete). None: malformed (when open, only if it can no longer become valid)."""
        raise NotImplementedError

    def feed(self, text: str) -> list[ParseEvent]:
        self._buf += text
        out: list[ParseEvent] = []
        while True:
            if self._in_block:
                end = self._buf.find(self.END)
                if end < 0:
                    out += self._progress(self._buf)
                    return out
                body, self._buf = self._buf[:end], self._buf[end + len(self.END):]
                out += self._close(body, self.END)
                continue
            start = self._buf.find(self.START)
            if start >= 0:
                out += self._content(self._buf[:start])
                self._buf = self._buf[start + len(self.START):]
                self._in_block, self._sent = True, []
                continue
            keep = _partial_suffix(self._buf, self.START)
            out += self._content(self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return out

    def finish(self) -> list[ParseEvent]:
        buf, self._buf = self._buf, ""
        if self._in_block:
            return self._close(buf, "")
        return self._content(buf)

    def _content(self, text: str) -> list[ParseEvent]:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return []
            self._after_call = False
        return [ContentDelta(text)] if text else []

    def _read(self, body: str, closed: bool) -> list[ParsedCall] | None:
        try:
            return self.read_block(body, closed)
        except (ValueError, TypeError, KeyError, AttributeError):
            return None

    def _progress(self, body: str) -> list[ParseEvent]:
        """An open block grew: send what its calls added."""
        if not self._incremental:
            return []
        calls = self._read(body, closed=False)
        return self._sync(calls) if calls else []

    def _close(self, body: str, end: str) -> list[ParseEvent]:
        self._in_block = False
        calls = self._read(body, closed=True)
        if calls and all(c.complete for c in calls):
            out = self._sync(calls)
        elif not self._sent:  # malformed or cut before anything went out: it was text
            return self._content(self.START + body + end)
        else:  # malformed after its calls began streaming: they stay as sent
            out = []
        self._after_call = True
        return out

    def _sync(self, calls: list[ParsedCall]) -> list[ParseEvent]:
        out: list[ParseEvent] = []
        for i, call in enumerate(calls):
            if i == len(self._sent):
                self._sent.append((self.calls, ""))
                out.append(ToolCallDelta(self.calls, call.id or new_call_id(), call.name, ""))
                self.calls += 1
            index, sent = self._sent[i]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                out.append(ToolCallDelta(index, arguments=call.arguments[len(sent):]))
                self._sent[i] = (index, call.arguments)
        return out


_OUTSIDE_STOP = re.compile(r'[^ \t\r\n,:\-+.0-9eEtrufalsn]')  # outside strings: brackets, quotes, junk
_INSIDE_STOP = re.compile(r'["\\]')  # inside a string: its end or an escape


def scan_json_object(text: str, pos: int) -> tuple[int, str]:
    """Scan the JSON object starting at `text[pos]` by its brackets and strings: `(end, state)` with
    state "done" (`text[pos:end]` is the whole object), "open" (it runs to the end of `text`) or
    "bad" (`text[end]` cannot occur there: not an object, or a character outside the JSON alphabet).
    Only brackets and strings are checked (`json.loads` confirms a done object); the regexes jump
    over everything else, so re-scanning a growing body each step stays cheap."""
    if not text.startswith("{", pos):
        return pos, "bad"
    depth, i = 0, pos
    while True:
        m = _OUTSIDE_STOP.search(text, i)
        if m is None:
            return len(text), "open"
        i, ch = m.start(), m.group()
        if ch == '"':
            i += 1
            while True:  # to the closing quote, stepping over escapes
                q = _INSIDE_STOP.search(text, i)
                if q is None:
                    return len(text), "open"
                if q.group() == '"':
                    i = q.end()
                    break
                if q.end() >= len(text):
                    return len(text), "open"
                i = q.end() + 1
            continue
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return (i + 1, "done") if ch == "}" else (i, "bad")
        else:
            return i, "bad"
        i += 1


_BEGUN = re.compile(r'\{\s*["}]')


def arguments_begun(arguments: str) -> bool:
    """Whether streamed object text has begun like an object (`{` then a key or `}`): a call is sent
    only from there, so a block whose JSON is junk from its first character stays content."""
    return _BEGUN.match(arguments) is not None


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
