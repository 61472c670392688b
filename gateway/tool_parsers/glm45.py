"""GLM-4.5 / GLM-4.6 / GLM-4.7 tool calls:

    <tool_call>NAME
    <arg_key>K</arg_key>
    <arg_value>V</arg_value>
    ...</tool_call>

A call with no arguments is just `<tool_call>NAME</tool_call>`. A value is text; it is
read as JSON (number, boolean, object, array) unless the tool's schema says the
parameter is a string or it is not valid JSON, as GLM's own parser does.
"""

from __future__ import annotations

import json
import re
from typing import Any

from gateway.tool_parsers.base import MarkerParser, ParsedCall

__all__ = ["Glm45Parser"]

_NAME = re.compile(r"\s*([^\s<]+)\s*")
_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>\s*", re.DOTALL)


class Glm45Parser(MarkerParser):
    START = "<tool_call>"
    END = "</tool_call>"

    def parse_block(self, body: str) -> list[ParsedCall] | None:
        m = _NAME.match(body)
        if m is None:
            return None
        name, pos = m.group(1), m.end()
        args: dict[str, Any] = {}
        while pos < len(body):
            pair = _PAIR.match(body, pos)
            if pair is None:
                return None  # anything else in the block: malformed
            key, value = pair.group(1).strip(), pair.group(2)
            args[key] = self._value(name, key, value)
            pos = pair.end()
        return [ParsedCall(name, json.dumps(args, ensure_ascii=False))]

    def _value(self, function: str, key: str, value: str) -> Any:
        if self.param_type(function, key) == "string":
            return value
        try:
            return json.loads(value)
        except ValueError:
            return value
