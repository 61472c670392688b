"""Hermes / Qwen2.5 / Qwen3 tool calls: `<tool_call>{"name": NAME, "arguments": {...}}</tool_call>`,
one block per call, the JSON on its own line(s); text around the blocks is content."""

from __future__ import annotations

import json

from gateway.tool_parsers.base import MarkerParser, ParsedCall

__all__ = ["HermesParser"]


class HermesParser(MarkerParser):
    START = "<tool_call>"
    END = "</tool_call>"

    def parse_block(self, body: str) -> list[ParsedCall] | None:
        obj = json.loads(body)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            args = json.loads(args)
        if not isinstance(args, dict):
            return None
        return [ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))]
