"""Kimi K2 tool calls: one section of calls, each with the model's own id `functions.NAME:IDX`
(kept as the OpenAI id, since Kimi's template writes it back in later turns):

    <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}
    <|tool_call_end|>...<|tool_calls_section_end|>

These markers are special tokens of Kimi's tokenizer: the gateway keeps them in the text it
decodes for this parser, and a grammar names them as special tokens. Streaming: a call's id
and name go out once its argument marker arrives, then its JSON as written.
"""

from __future__ import annotations

import json
import re
from typing import Any

from gateway.tool_parsers.base import Lit, MarkerParser, ParsedCall, arguments_begun, scan_json_object

__all__ = ["KimiK2Parser"]

_CALL_BEGIN, _ARG_BEGIN, _CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
_HEAD = re.compile(r"\s*<\|tool_call_begin\|>\s*([^\s<]+?)\s*<\|tool_call_argument_begin\|>\s*")
_TAIL = re.compile(r"\s*<\|tool_call_end\|>\s*")
_ID = re.compile(r"(?:functions\.)?([\w\-.]+):\d+")


class KimiK2Parser(MarkerParser):
    START = "<|tool_calls_section_begin|>"
    END = "<|tool_calls_section_end|>"
    MARKERS = (START, END, _CALL_BEGIN, _ARG_BEGIN, _CALL_END)

    def read_block(self, body: str, closed: bool) -> list[ParsedCall] | None:
        calls, pos = [], 0
        while pos < len(body):
            head = _HEAD.match(body, pos)
            if head is None:
                return None if closed and body[pos:].strip() else calls
            call_id = head.group(1)
            ident = _ID.fullmatch(call_id)
            if ident is None:
                return None
            end, state = scan_json_object(body, head.end())
            arguments = body[head.end():end]
            if state != "done":
                if closed or state == "bad":
                    return None
                if not arguments_begun(arguments):
                    return calls
                return [*calls, ParsedCall(ident.group(1), arguments, call_id, complete=False)]
            if not isinstance(json.loads(arguments), dict):
                return None
            tail = _TAIL.match(body, end)
            if tail is None:
                if closed:
                    return None
                return [*calls, ParsedCall(ident.group(1), arguments, call_id, complete=False)]
            calls.append(ParsedCall(ident.group(1), arguments, call_id))
            pos = tail.end()
        return calls

    @classmethod
    def call_grammar(cls, name: str, parameters: dict[str, Any], rule: str, lit: Lit) -> list[str]:
        from gateway.tool_grammar import json_rule

        fid = json.dumps(f"functions.{name}:", ensure_ascii=False)
        return [f"{rule}: {lit(_CALL_BEGIN)} {fid} /[0-9]{{1,4}}/ {lit(_ARG_BEGIN)} {rule}_args {lit(_CALL_END)}",
                json_rule(f"{rule}_args", parameters)]

    @classmethod
    def calls_grammar(cls, call: str, many: bool, lit: Lit) -> str:
        return f"{lit(cls.START)} {call}{'+' if many else ''} {lit(cls.END)}"
