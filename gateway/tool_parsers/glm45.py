"""GLM-4.5 / GLM-4.6 / GLM-4.7 tool calls:

    <tool_call>NAME
    <arg_key>K</arg_key>
    <arg_value>V</arg_value>
    ...</tool_call>

A call with no arguments is just `<tool_call>NAME</tool_call>`. A value is text; it is
read as JSON (number, boolean, object, array) unless the tool's schema says the
parameter is a string or it is not valid JSON, as GLM's own parser does.

Streaming: the call's id and name go out with its first complete pair (a zero-argument
call when it closes); the arguments object is built as `{"K": V, ...}` (json.dumps's separators) and sent a pair at a
time, as each `</arg_value>` arrives, its closing brace with `</tool_call>`.

Grammar (`tool_choice` "required" / named): the parameters are written as key/value pairs
in the schema's property order, required ones always, optional ones maybe; a string
parameter's value is raw text up to `</arg_value>` (an `enum` becomes a choice of its
strings), any other parameter is JSON of its own schema. A schema this cannot enforce (not
an object of properties, `patternProperties`, a string with `pattern`, `format` or length
bounds) is refused with a 400 naming why.
"""

from __future__ import annotations

import json
import re
from typing import Any

from backend.errors import InvalidSamplingParams
from gateway.tool_parsers.base import Lit, MarkerParser, ParsedCall

__all__ = ["Glm45Parser"]

_KEY_OPEN, _KEY_CLOSE, _VALUE_OPEN, _VALUE_CLOSE = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
_NAME = re.compile(r"\s*([^\s<]+)\s*")
_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>\s*", re.DOTALL)
# object keywords the pair form can enforce; any other one (patternProperties, minProperties, ...) cannot
_OBJECT_KEYS = {"type", "properties", "required", "additionalProperties", "description", "title", "$schema"}
_STRING_KEYS = {"type", "description", "title", "enum", "const", "default", "examples"}


class Glm45Parser(MarkerParser):
    START = "<tool_call>"
    END = "</tool_call>"
    MARKERS = (START, END, _KEY_OPEN, _KEY_CLOSE, _VALUE_OPEN, _VALUE_CLOSE)

    def read_block(self, body: str, closed: bool) -> list[ParsedCall] | None:
        m = _NAME.match(body)
        if m is None or (not closed and m.end() == len(body)):  # no name yet, or it may still grow
            return None if closed else []
        name, pos = m.group(1), m.end()
        pairs: list[str] = []
        while pos < len(body):
            pair = _PAIR.match(body, pos)
            if pair is None:
                if closed:
                    return None  # anything else in the block: malformed
                break  # a pair still arriving
            key, value = pair.group(1).strip(), pair.group(2)
            pairs.append(f"{json.dumps(key, ensure_ascii=False)}: "
                         f"{json.dumps(self._value(name, key, value), ensure_ascii=False)}")
            pos = pair.end()
        if closed:
            return [ParsedCall(name, "{" + ", ".join(pairs) + "}")]
        return [ParsedCall(name, "{" + ", ".join(pairs), complete=False)] if pairs else []  # sent from its first pair

    def _value(self, function: str, key: str, value: str) -> Any:
        if self.param_type(function, key) == "string":
            return value
        try:
            return json.loads(value)
        except ValueError:
            return value

    @classmethod
    def call_grammar(cls, name: str, parameters: dict[str, Any], rule: str, lit: Lit) -> list[str]:
        from gateway.tool_grammar import json_rule

        def refuse(why: str) -> InvalidSamplingParams:
            return InvalidSamplingParams(f"tool {name!r}: the glm45 call format writes arguments as key/value "
                                         f"text and cannot enforce {why}", field="tool_choice")

        extra = set(parameters) - _OBJECT_KEYS
        if parameters.get("type", "object") != "object" or extra:
            raise refuse(f"this parameters schema ({', '.join(sorted(extra)) or 'not an object'})")
        props = parameters.get("properties") or {}
        if not isinstance(props, dict):
            raise refuse("`properties` that is not an object")
        required = set(parameters.get("required") or [])
        if not required <= set(props):
            raise refuse(f"required parameters without a schema ({', '.join(sorted(required - set(props)))})")
        rules, items = [], []
        for i, (key, schema) in enumerate(props.items()):
            value = f"{rule}_v{i}"
            if not isinstance(schema, dict):
                raise refuse(f"parameter {key!r}: its schema is not an object")
            if schema.get("type") == "string":
                if set(schema) - _STRING_KEYS:
                    raise refuse(f"parameter {key!r}: {', '.join(sorted(set(schema) - _STRING_KEYS))}")
                choices = schema.get("enum", [schema["const"]] if "const" in schema else None)
                if choices is not None:
                    if not all(isinstance(c, str) for c in choices):
                        raise refuse(f"parameter {key!r}: a string enum of non-strings")
                    rules.append(f"{value}: ({' | '.join(json.dumps(c, ensure_ascii=False) for c in choices)}) "
                                 f"{lit(_VALUE_CLOSE)}")
                elif lit(_VALUE_CLOSE).startswith("<"):  # a special token ends the free text
                    rules.append(f"{value}: /(?s:.*)/ {lit(_VALUE_CLOSE)}")
                else:  # the shortest text up to the first closing marker
                    rules.append(f"{value}[lazy]: /(?s:.*)<\\/arg_value>/")
            else:
                rules += [f"{value}: {value}_json {lit(_VALUE_CLOSE)}", json_rule(f"{value}_json", schema)]
            item = (f'{lit(_KEY_OPEN)} {json.dumps(key, ensure_ascii=False)} {lit(_KEY_CLOSE)} "\\n" '
                    f'{lit(_VALUE_OPEN)} {value} "\\n"')
            items.append(item if key in required else f"({item})?")
        fname = json.dumps(name, ensure_ascii=False)
        body = f'{fname} "\\n" {" ".join(items)}' if items else fname
        return [f"{rule}: {lit(cls.START)} {body} {lit(cls.END)}", *rules]

    @classmethod
    def calls_grammar(cls, call: str, many: bool, lit: Lit) -> str:
        return f'{call} ("\\n" {call})*' if many else call
