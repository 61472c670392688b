"""OpenAI `tools` / `tool_choice` on chat completions: the request side and the response side.

Request: `tools` is a list of `{"type": "function", "function": {"name", "description"?,
"parameters"?}}`, rendered by the model's chat template (its `tools` variable);
`tool_choice` is `auto` (default with tools), `none` (the tools are still shown to
the template, as OpenAI does, but the output is not parsed for calls), `required` (one
or more calls) or `{"type": "function", "function": {"name": ...}}` (that call): the last
two are enforced by a grammar in the family's call syntax (`tool_grammar.py`). Tool
definitions and earlier calls are the client's text inside the template's own text,
so they may not spell the model's control tokens (refused, `InvalidRequest`).

Response: the model's text goes through the family's parser (`tool_parsers/`).
`ToolCallStream` turns parser events into OpenAI chunk deltas (a call's index, id,
type and name first, then `function.arguments` fragments; text outside calls stays
`content`); `tool_message` builds the non-streamed `message`. A response with calls
and a natural end has `finish_reason` "tool_calls".
"""

from __future__ import annotations

import json
from typing import Any

from backend.errors import InvalidRequest
from gateway.tool_parsers import ContentDelta, ParseEvent, ToolCallDelta, ToolParser
from gateway.tool_parsers.base import collect

__all__ = ["check_tools", "workers_tools", "workers_tool_calls", "tool_choice_mode", "check_no_control_text", "ToolCallStream", "tool_message",
           "finish_reason_with_tools"]


def check_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """`tools` as validated dicts; `InvalidRequest` naming the first bad entry."""
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise InvalidRequest('each tool must be {"type": "function", "function": {...}}', field=f"tools[{i}]")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidRequest("a function needs a `name`", field=f"tools[{i}].function.name")
        if not isinstance(fn.get("parameters", {}), dict):
            raise InvalidRequest("`parameters` must be a JSON schema object", field=f"tools[{i}].function.parameters")
    return tools


def workers_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """Workers AI `tools` as OpenAI's: each `{"name", "description"?, "parameters"?}` (Workers AI's
    traditional function-calling shape) or `{"type": "function", "function": {...}}` (accepted too)."""
    out = []
    for i, tool in enumerate(tools):
        if isinstance(tool, dict) and "function" not in tool and "type" not in tool:
            tool = {"type": "function", "function": tool}
        out.append(tool)
        if not isinstance(tool, dict):
            raise InvalidRequest('each tool must be {"name", "description", "parameters"}', field=f"tools[{i}]")
    return check_tools(out)


def workers_tool_calls(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat message's calls in Workers AI's shape: `{"name", "arguments", "id"}` with the arguments
    as an object (what Workers AI's traditional function calling returns in `result.tool_calls`),
    plus the call's id so a later turn's `tool_call_id` can answer it (Kimi's `functions.NAME:IDX`)."""
    return [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"]), "id": c["id"]}
            for c in message.get("tool_calls") or []]


def tool_choice_mode(choice: Any, tools: list[dict[str, Any]] | None) -> str:
    """`"auto"`, `"none"`, `"required"` or `"named"` for a request's `tool_choice` (default `auto`
    with tools, `none` without); every mode but `none` needs `tools`."""
    if choice is None:
        return "auto" if tools else "none"
    if choice in ("auto", "none", "required") or isinstance(choice, dict):
        mode = choice if isinstance(choice, str) else "named"
        if mode != "none" and not tools:
            raise InvalidRequest("`tool_choice` needs `tools`", field="tool_choice")
        return mode
    raise InvalidRequest("`tool_choice` must be `auto`, `none`, `required` or a function", field="tool_choice")


def check_no_control_text(value: Any, specials: list[str], field: str) -> None:
    """Refuse client JSON (tools, earlier calls) that spells one of the model's control tokens: the
    template places it among its own text, where it would be encoded as a control token."""
    text = json.dumps(value, ensure_ascii=False)
    for token in specials:
        if token and token in text:
            raise InvalidRequest(f"{field} spells the model's control token {token!r}", field=field)


class ToolCallStream:
    """Model text deltas → OpenAI chunk `delta`s, through one parser."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser

    def feed(self, text: str) -> list[dict[str, Any]]:
        return _deltas(self.parser.feed(text)) if text else []

    def finish(self) -> list[dict[str, Any]]:
        return _deltas(self.parser.finish())

    @property
    def called(self) -> bool:
        return self.parser.calls > 0


def _deltas(events: list[ParseEvent]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for ev in events:
        if isinstance(ev, ContentDelta):
            out.append({"content": ev.text})
        elif isinstance(ev, ToolCallDelta):
            call: dict[str, Any] = {"index": ev.index}
            if ev.id is not None:
                call.update(id=ev.id, type="function", function={"name": ev.name, "arguments": ""})
            else:
                call["function"] = {"arguments": ev.arguments}
            out.append({"tool_calls": [call]})
    return out


def tool_message(parser: ToolParser, text: str) -> dict[str, Any]:
    """The non-streamed assistant `message` for the whole output `text`."""
    content, calls = collect(parser.parse_whole(text))
    if not calls:
        return {"role": "assistant", "content": content}
    return {"role": "assistant", "content": content or None,
            "tool_calls": [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                           for c in calls]}


def finish_reason_with_tools(reason: str, called: bool) -> str:
    """OpenAI's `finish_reason`: "tool_calls" when the output ended naturally after making calls."""
    return "tool_calls" if called and reason == "stop" else reason
