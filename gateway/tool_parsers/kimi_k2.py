"""Kimi K2 tool calls: one section of calls, each with the model's own id `functions.NAME:IDX`
(kept as the OpenAI id, since Kimi's template writes it back in later turns):

    <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}
    <|tool_call_end|>...<|tool_calls_section_end|>

These markers are special tokens of Kimi's tokenizer.
"""

from __future__ import annotations

import json
import re

from gateway.tool_parsers.base import MarkerParser, ParsedCall

__all__ = ["KimiK2Parser"]

_CALL = re.compile(r"\s*<\|tool_call_begin\|>\s*([^\s<]+?)\s*<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>\s*",
                   re.DOTALL)
_ID = re.compile(r"(?:functions\.)?([\w\-.]+):\d+")


class KimiK2Parser(MarkerParser):
    START = "<|tool_calls_section_begin|>"
    END = "<|tool_calls_section_end|>"

    def parse_block(self, body: str) -> list[ParsedCall] | None:
        calls, pos = [], 0
        while pos < len(body):
            m = _CALL.match(body, pos)
            if m is None:
                return None
            call_id, raw = m.group(1), m.group(2)
            ident = _ID.fullmatch(call_id)
            args = json.loads(raw)
            if ident is None or not isinstance(args, dict):
                return None
            calls.append(ParsedCall(ident.group(1), json.dumps(args, ensure_ascii=False), call_id))
            pos = m.end()
        return calls
