"""Hermes / Qwen2.5 / Qwen3 tool calls: `<tool_call>{"name": NAME, "arguments": {...}}</tool_call>`,
one block per call, the JSON on its own line(s); text around the blocks is content.

Streaming: once a block reads `{"name": "NAME", "arguments": {`, the call's id and name go
out and its arguments follow as written, fragment by fragment, up to the object's closing
brace (`scan_json_object`). A block in another shape (keys the other way round, arguments
as a JSON string, `parameters` for `arguments`) is read whole when it closes.

Grammar (`tool_choice` "required" / named): `<tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>`
as the template writes earlier calls, ARGS the function's parameters schema (`%json`), calls
separated by a newline.
"""

from __future__ import annotations

import json
import re
from typing import Any

from gateway.tool_parsers.base import Lit, MarkerParser, ParsedCall, arguments_begun, scan_json_object

__all__ = ["HermesParser"]

_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)+)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


class HermesParser(MarkerParser):
    START = "<tool_call>"
    END = "</tool_call>"
    MARKERS = (START, END)

    def read_block(self, body: str, closed: bool) -> list[ParsedCall] | None:
        head = _HEAD.match(body)
        if head is not None and body.startswith("{", head.end()):
            name = json.loads(f'"{head.group(1)}"')
            end, state = scan_json_object(body, head.end())
            arguments = body[head.end():end]
            if state == "done":
                if not isinstance(json.loads(arguments), dict):
                    return None
                if closed and body[end:].strip() != "}":
                    return None
                return [ParsedCall(name, arguments)]
            if closed or state == "bad":
                return None
            return [ParsedCall(name, arguments, complete=False)] if arguments_begun(arguments) else []
        if not closed:
            return []
        obj = json.loads(body)  # another shape: read whole
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            args = json.loads(args)
        if not isinstance(args, dict):
            return None
        return [ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))]

    @classmethod
    def call_grammar(cls, name: str, parameters: dict[str, Any], rule: str, lit: Lit) -> list[str]:
        from gateway.tool_grammar import json_rule

        head = json.dumps('\n{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": ',
                          ensure_ascii=False)
        return [f'{rule}: {lit(cls.START)} {head} {rule}_args "}}\\n" {lit(cls.END)}',
                json_rule(f"{rule}_args", parameters)]

    @classmethod
    def calls_grammar(cls, call: str, many: bool, lit: Lit) -> str:
        return f'{call} ("\\n" {call})*' if many else call
