"""A grammar spec as llguidance grammar text, checked: what the gateway needs of `backend.grammar`.

Kept apart from the decoding side (`grammar.py`, which needs torch for its masks) so a
gateway validating `response_format` and `tool_choice` never imports torch (about 2.5 s
and 300 MB at start). JSON is compiled compact (`whitespace_flexible` off).
"""

from __future__ import annotations

import json

import llguidance

from backend.errors import InvalidSamplingParams
from backend.sampling_params import GrammarSpec

__all__ = ["grammar_of", "JSON_OBJECT_SCHEMA", "COMPILE_OPTIONS"]

JSON_OBJECT_SCHEMA = '{"type": "object"}'  # `json_object`: any JSON object
COMPILE_OPTIONS: llguidance.JsonCompileOptions = {"whitespace_flexible": False}


def grammar_of(spec: GrammarSpec) -> str:
    """llguidance grammar text for `spec`; InvalidSamplingParams (field `response_format`, `tool_choice`
    for a Lark grammar) when the schema is not a JSON object or llguidance refuses it (unknown type,
    bad `$ref`, a Lark syntax error, ...)."""
    if spec.kind == "lark":
        try:
            grammar = llguidance.LLMatcher.grammar_from_lark(spec.schema)
        except (ValueError, TypeError) as exc:
            raise InvalidSamplingParams(f"invalid grammar: {exc}", field="tool_choice") from exc
        error = llguidance.LLMatcher.validate_grammar(grammar, None)
        if error:
            raise InvalidSamplingParams(f"invalid grammar: {error}", field="tool_choice")
        return grammar
    if spec.kind == "json_object":
        schema = JSON_OBJECT_SCHEMA
    elif spec.kind == "json_schema":
        schema = spec.schema
    else:
        raise InvalidSamplingParams(f"unknown grammar kind {spec.kind!r}", field="response_format")
    try:
        if not isinstance(json.loads(schema), dict):
            raise ValueError("a JSON schema is an object")
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=COMPILE_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise InvalidSamplingParams(f"invalid JSON schema: {exc}", field="response_format") from exc
    error = llguidance.LLMatcher.validate_grammar(grammar, None)
    if error:
        raise InvalidSamplingParams(f"invalid JSON schema: {error}", field="response_format")
    return grammar
