"""`tool_choice` "required" and named functions, enforced: a Lark grammar for llguidance that only
lets the model write tool calls in its family's syntax, with arguments valid for the tool.

    spec = tool_choice_grammar(parser_class, tools, choice, tokenizer, many=..., reasoning=..., in_think=...)
    SamplingParams(..., grammar=spec)          # GrammarSpec("lark", text): travels to the worker like
                                               # response_format's grammars (backend/grammar.py)

The grammar is `start: [reasoning] calls`:

- `calls` is the parser's own (`ToolParser.calls_grammar`): one call for a named function
  (or for "required" with `parallel_tool_calls: false`), one or more for "required";
- each call (`ToolParser.call_grammar`) spells the family's markers, the function's name
  (only the named one, or any of the request's tools) and its arguments as JSON under the
  tool's `parameters` schema (`%json`, compact with json.dumps's separators, the way chat
  templates render earlier calls; a top-level schema that lists `properties` without saying
  `additionalProperties` gets it false, so the model cannot invent keys: the output still
  validates against the schema as given);
- markers that are special tokens of the model's tokenizer (Kimi's `<|tool_call_begin|>`)
  are written as special-token references (`<|tool_call_begin|>`), others as text;
- with a reasoning parser, an optional think block comes first (required when the prompt
  already opened it): any text up to the closing marker, then the calls.

After the calls only EOS is allowed, so the output is calls and nothing else; the parser
then reads them as usual and their arguments always parse and validate.
"""

from __future__ import annotations

import json
import re
from typing import Any

from backend.errors import InvalidRequest, InvalidSamplingParams
from backend.grammar_text import grammar_of
from backend.sampling_params import GrammarSpec
from backend.tokenizer import Tokenizer
from gateway.tool_parsers.base import Lit, ToolParser

__all__ = ["tool_choice_grammar", "json_rule", "marker_literal", "chosen_tools"]

# compact JSON with json.dumps's separators (what templates render with `tojson`): no free whitespace
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def json_rule(rule: str, schema: dict[str, Any]) -> str:
    """A Lark rule `rule` matching compact JSON valid under `schema`."""
    schema = dict(schema)
    if schema.get("type") == "object" and "properties" in schema and "additionalProperties" not in schema:
        schema["additionalProperties"] = False
    return f"{rule}: %json {json.dumps({'x-guidance': _JSON_OPTIONS, **schema}, ensure_ascii=False)}"


def marker_literal(tokenizer: Tokenizer) -> Lit:
    """`lit(marker)`: a special-token reference when `marker` is one of the tokenizer's special tokens
    (llguidance matches it as that token, never as text), else a quoted string."""
    specials = set(tokenizer.control_tokens)
    return lambda marker: marker if marker in specials else json.dumps(marker, ensure_ascii=False)


def chosen_tools(tools: list[dict[str, Any]], choice: Any) -> list[dict[str, Any]]:
    """The tools a `required` (all) or named choice allows; InvalidRequest for a name not among `tools`."""
    if choice == "required":
        return tools
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise InvalidRequest('a named `tool_choice` is {"type": "function", "function": {"name": ...}}',
                             field="tool_choice")
    named = [t for t in tools if t["function"]["name"] == fn["name"]]
    if not named:
        raise InvalidRequest(f"`tool_choice` names {fn['name']!r}, which is not among `tools`",
                             field="tool_choice.function.name")
    return named[:1]


def _think_rules(start: str, end: str, lit: Lit, in_think: bool, implicit: bool) -> tuple[str, list[str]]:
    """The reasoning prefix of `start` and its rules."""
    if lit(end) == end:  # a special token ends the free text
        rest = f"think_rest: /(?s:.*)/ {end}"
    else:  # the shortest text up to the first closing marker
        rest = f"think_rest[lazy]: /(?s:.*){re.escape(end).replace('/', chr(92) + '/')}/"
    rules = [rest, "think: think_rest /[ \\n]{0,4}/"]
    if in_think:
        return "think ", rules
    opening = f"{lit(start)}?" if implicit else lit(start)
    return f"({opening} think)? ", rules


def tool_choice_grammar(parser: type[ToolParser], tools: list[dict[str, Any]], choice: Any, tokenizer: Tokenizer,
                        *, many: bool = True, reasoning: tuple[str, str, bool] | None = None,
                        in_think: bool = False) -> GrammarSpec:
    """The grammar forcing `choice` ("required" or a named function) in `parser`'s syntax.

    `many`: "required" may make several calls (False: `parallel_tool_calls` is false, one call).
    `reasoning`: the reasoning parser's (start, end, implicit start) markers when one is active;
    `in_think`: the prompt ends inside a think block. Raises InvalidRequest / InvalidSamplingParams
    (400, field `tool_choice`) for an unknown name or a schema the family's syntax cannot enforce."""
    lit = marker_literal(tokenizer)
    chosen = chosen_tools(tools, choice)
    rules: list[str] = []
    for i, tool in enumerate(chosen):
        fn = tool["function"]
        rules += parser.call_grammar(fn["name"], fn.get("parameters") or _EMPTY_PARAMETERS, f"c{i}", lit)
    rules.append("call: " + " | ".join(f"c{i}" for i in range(len(chosen))))
    prefix = ""
    if reasoning is not None:
        prefix, think = _think_rules(*reasoning[:2], lit, in_think, reasoning[2])
        rules += think
    text = "\n".join([f"start: {prefix}{parser.calls_grammar('call', many and choice == 'required', lit)}", *rules])
    spec = GrammarSpec("lark", text)
    try:
        grammar_of(spec)
    except InvalidSamplingParams as exc:
        raise InvalidSamplingParams(f"the tools' parameters cannot be enforced: {exc.message}",
                                    field="tool_choice") from exc
    return spec
