"""`response_format` of both APIs, read into the worker's `GrammarSpec` (structured output).

OpenAI:     {"type": "text"} | {"type": "json_object"}
            | {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": true}}
Workers AI: {"type": "json_object"} | {"type": "json_schema", "json_schema": {...the schema...}}
            (OpenAI's wrapped form, with `schema` inside, is accepted there too)

The schema is checked here (`backend.grammar_text.grammar_of`: llguidance compiles it without a
tokenizer), so an invalid one is a 400 naming `response_format` before any worker is asked;
the worker checks it again. Decoding is constrained whether `strict` is true or not: the
output always follows the schema, cut only by `max_tokens` (`finish_reason` "length").
"""

from __future__ import annotations

import json
from typing import Any

from backend.errors import InvalidRequest, InvalidSamplingParams
from backend.grammar_text import grammar_of
from backend.sampling_params import GrammarSpec

__all__ = ["openai_grammar", "workers_grammar", "TRUNCATED_JSON_NOTICE"]

TRUNCATED_JSON_NOTICE = 3042  # Workers `messages` code: max_tokens cut the JSON, `response` is its text


def _spec(kind: str, schema: Any) -> GrammarSpec:
    if kind == "json_object":
        spec = GrammarSpec("json_object")
    else:
        if not isinstance(schema, dict):
            raise InvalidRequest("`response_format.json_schema` must hold a JSON schema object",
                                 field="response_format.json_schema")
        spec = GrammarSpec("json_schema", json.dumps(schema))
    grammar_of(spec)  # raises InvalidSamplingParams naming response_format
    return spec


def _kind(rf: dict[str, Any]) -> str | None:
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind not in ("json_object", "json_schema"):
        raise InvalidSamplingParams("response_format type must be `text`, `json_object` or `json_schema`",
                                    field="response_format.type")
    return kind


def openai_grammar(rf: dict[str, Any] | None) -> GrammarSpec | None:
    """The grammar an OpenAI `response_format` asks for (None for text); typed 400s otherwise."""
    kind = None if rf is None else _kind(rf)
    if kind is None:
        return None
    if kind == "json_object":
        return _spec(kind, None)
    js = rf.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
        raise InvalidRequest("`response_format.json_schema` must be an object with a `schema`",
                             field="response_format.json_schema")
    return _spec(kind, js.get("schema", {}))


def workers_grammar(rf: dict[str, Any] | None) -> GrammarSpec | None:
    """The grammar a Workers AI `response_format` asks for (None for text); typed 400s otherwise."""
    kind = None if rf is None else _kind(rf)
    if kind is None:
        return None
    schema = rf.get("json_schema")
    if isinstance(schema, dict) and isinstance(schema.get("schema"), dict) and "type" not in schema:
        schema = schema["schema"]  # OpenAI's wrapped form
    return _spec(kind, schema)
