"""Request bodies of the public API (msgspec structs) and their validation.

Decoding is strict about types and ranges and names the offending field in the
error (`InvalidRequest`, 400, `field` as a path such as `messages[0].content`; a
missing field is named too, which OpenAI's clients read as `param`); fields the API documents but we do not implement
(penalties, logprobs, tools, n > 1) are refused with `InvalidSamplingParams`
naming the field rather than silently ignored. Unknown fields are ignored, as
the platforms we mirror do.

Hostile bodies are bounded before they are decoded: JSON nested deeper than
`MAX_JSON_DEPTH` (anywhere, unknown fields included) is refused with
`InvalidRequest`, never a `RecursionError`; stop strings are capped in number
(`MAX_STOP_STRINGS`) and length (`MAX_STOP_CHARS`), since every generated token
is checked against each of them.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta

from backend.errors import InvalidRequest, InvalidSamplingParams
from backend.sampling_params import MAX_STOP_STRINGS

__all__ = [
    "ContentPart",
    "Message",
    "WorkersRunRequest",
    "StreamOptions",
    "ChatCompletionRequest",
    "decode_body",
    "plain_messages",
    "MAX_JSON_DEPTH",
    "MAX_STOP_CHARS",
]

MAX_TOKENS_LIMIT = 131072
MAX_JSON_DEPTH = 32  # a chat request needs 4 levels; OpenAI tool schemas nest a few more
MAX_STOP_CHARS = 256
StopString = Annotated[str, Meta(min_length=1, max_length=MAX_STOP_CHARS)]
Seed = Annotated[int, Meta(ge=0, le=2**63 - 1)]
T = TypeVar("T")


class ContentPart(msgspec.Struct, frozen=True):
    type: str
    text: str | None = None


class Message(msgspec.Struct, frozen=True):
    role: Literal["system", "user", "assistant"]
    content: str | list[ContentPart]


class WorkersRunRequest(msgspec.Struct, frozen=True):
    """`POST /client/v4/accounts/{account_id}/ai/run/{model}` (text generation)."""

    prompt: Annotated[str, Meta(min_length=1)] | None = None
    messages: Annotated[list[Message], Meta(min_length=1)] | None = None
    max_tokens: Annotated[int, Meta(ge=1, le=MAX_TOKENS_LIMIT)] = 256
    temperature: Annotated[float, Meta(ge=0.0, le=5.0)] = 0.6
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=1, le=50)] | None = None
    seed: Seed | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    stream: bool = False
    raw: bool = False  # the prompt is sent as is, without the chat template

    def validate(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequest("give exactly one of `prompt` or `messages`", field="prompt")
        _refuse_penalties(repetition_penalty=(self.repetition_penalty, 1.0),
                          frequency_penalty=(self.frequency_penalty, 0.0),
                          presence_penalty=(self.presence_penalty, 0.0))
        if self.raw and self.messages is not None:
            raise InvalidRequest("`raw` applies to `prompt` only", field="raw")


class StreamOptions(msgspec.Struct, frozen=True):
    include_usage: bool = False


class ChatCompletionRequest(msgspec.Struct, frozen=True):
    """OpenAI `POST /v1/chat/completions`."""

    model: str
    messages: Annotated[list[Message], Meta(min_length=1)]
    max_tokens: Annotated[int, Meta(ge=1, le=MAX_TOKENS_LIMIT)] | None = None
    max_completion_tokens: Annotated[int, Meta(ge=1, le=MAX_TOKENS_LIMIT)] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    n: Annotated[int, Meta(ge=1)] = 1
    stop: StopString | Annotated[list[StopString], Meta(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: Seed | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None
    user: str | None = None

    def validate(self) -> None:
        if self.n != 1:
            raise InvalidSamplingParams("only n=1 is supported", field="n")
        _refuse_penalties(frequency_penalty=(self.frequency_penalty, 0.0),
                          presence_penalty=(self.presence_penalty, 0.0))
        for field in ("logprobs", "top_logprobs", "logit_bias", "tools"):
            if getattr(self, field):
                raise InvalidSamplingParams(f"`{field}` is not supported", field=field)
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise InvalidSamplingParams("only response_format type `text` is supported", field="response_format")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("`stream_options` needs `stream: true`", field="stream_options")

    @property
    def stop_list(self) -> list[str]:
        """`stop` as a list (each string non-empty and bounded by the schema)."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


def _refuse_penalties(**fields: tuple[float | None, float]) -> None:
    for name, (value, neutral) in fields.items():
        if value is not None and value != neutral:
            raise InvalidSamplingParams(f"`{name}` is not supported (only the neutral value {neutral})", field=name)


_FIELD_AT = re.compile(r"at `\$\.?([^`]*)`")
_MISSING = re.compile(r"missing required field `([^`]*)`")
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = bytes(sorted(set(range(256)) - set(b"[]{}")))


def _json_depth(body: bytes) -> int:
    """How deeply `body` nests arrays and objects (brackets inside strings do not count).

    Cheap: a body with few brackets is not scanned; otherwise strings are cut out by a
    regex and only the brackets left are walked. On malformed JSON the result may be an
    overestimate, never an underestimate of what a parser would reach before it fails."""
    if body.count(b"[") + body.count(b"{") <= MAX_JSON_DEPTH:
        return 0
    depth = deepest = 0
    for byte in _JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKET):
        if byte in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def decode_body(body: bytes, schema: type[T]) -> T:
    """Decode and validate a JSON body; errors are `InvalidRequest` naming the field."""
    if not body.strip():
        raise InvalidRequest("empty request body; expected a JSON object")
    if _json_depth(body) > MAX_JSON_DEPTH:
        raise InvalidRequest(f"request body nests JSON deeper than {MAX_JSON_DEPTH} levels")
    try:
        req = msgspec.json.decode(body, type=schema)
    except RecursionError as exc:  # the depth check bounds this; kept so no body can reach a traceback
        raise InvalidRequest(f"request body nests JSON deeper than {MAX_JSON_DEPTH} levels") from exc
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"invalid request: {exc}", field=_field_of(str(exc))) from exc
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"malformed JSON: {exc}") from exc
    validate = getattr(req, "validate", None)
    if validate is not None:
        validate()
    return req


def _field_of(error: str) -> str:
    """The field a msgspec validation error is about, as a path: `messages[0].content` for a
    missing `content` at `$.messages[0]`, `model` for a missing top-level `model`."""
    at, missing = _FIELD_AT.search(error), _MISSING.search(error)
    path = at.group(1) if at else ""
    if missing:
        path = f"{path}.{missing.group(1)}" if path else missing.group(1)
    return path


def plain_messages(messages: list[Message]) -> list[dict[str, str]]:
    """Messages as chat templates expect them: text parts joined, anything else refused."""
    out = []
    for i, m in enumerate(messages):
        if isinstance(m.content, str):
            text = m.content
        else:
            if any(p.type != "text" or p.text is None for p in m.content):
                raise InvalidRequest("only text content parts are supported", field=f"messages[{i}].content")
            text = "".join(p.text or "" for p in m.content)
        out.append({"role": m.role, "content": text})
    return out
