"""Request bodies of the public API (msgspec structs) and their validation.

Decoding is strict about types and ranges and names the offending field in the
error (`InvalidRequest`, 400, `field` as a path such as `messages[0].content`; a
missing field is named too, which OpenAI's clients read as `param`); fields the API documents but we do not implement
(logit_bias, n > 1, suffix, best_of > 1) are refused with `InvalidSamplingParams`
naming the field rather than silently ignored. Unknown fields are ignored, as
the platforms we mirror do. Penalties take OpenAI's range [-2, 2] (frequency,
presence) and Workers AI's (0, 2] (repetition); `top_logprobs` / completions'
`logprobs` at most `MAX_TOP_LOGPROBS` (20). `response_format` is read by
`response_format.py` (structured output), `tools` / `tool_choice` by `tools.py`.

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
from backend.sampling_params import MAX_STOP_STRINGS, MAX_TOP_LOGPROBS

__all__ = [
    "ContentPart",
    "ToolCall",
    "ToolCallFunction",
    "Message",
    "WorkersRunRequest",
    "StreamOptions",
    "ChatCompletionRequest",
    "CompletionRequest",
    "MAX_PROMPTS",
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
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]  # OpenAI's frequency / presence range
RepetitionPenalty = Annotated[float, Meta(gt=0.0, le=2.0)]  # Workers AI's; 1 is neutral
TopLogprobs = Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)]
MAX_PROMPTS = 128  # prompts in one /v1/completions request (each one generation)
T = TypeVar("T")


class ContentPart(msgspec.Struct, frozen=True):
    type: str
    text: str | None = None


class ToolCallFunction(msgspec.Struct, frozen=True):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(msgspec.Struct, frozen=True):
    """A call an earlier assistant turn made (sent back in the conversation)."""

    id: str
    function: ToolCallFunction
    type: Literal["function"] = "function"


class Message(msgspec.Struct, frozen=True):
    """A chat message; `tool` messages answer a call (`tool_call_id`), assistant messages may carry
    `tool_calls` and no content."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class WorkersRunRequest(msgspec.Struct, frozen=True):
    """`POST /client/v4/accounts/{account_id}/ai/run/{model}` (text generation)."""

    prompt: Annotated[str, Meta(min_length=1)] | None = None
    messages: Annotated[list[Message], Meta(min_length=1)] | None = None
    max_tokens: Annotated[int, Meta(ge=1, le=MAX_TOKENS_LIMIT)] = 256
    temperature: Annotated[float, Meta(ge=0.0, le=5.0)] = 0.6
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=1, le=50)] | None = None
    seed: Seed | None = None
    repetition_penalty: RepetitionPenalty | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    stream: bool = False
    raw: bool = False  # the prompt is sent as is, without the chat template
    response_format: dict[str, Any] | None = None  # JSON mode (gateway/response_format.py)
    tools: list[Any] | None = None  # Workers AI or OpenAI shape (gateway/tools.py: workers_tools)

    def validate(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequest("give exactly one of `prompt` or `messages`", field="prompt")
        if self.raw and self.messages is not None:
            raise InvalidRequest("`raw` applies to `prompt` only", field="raw")
        if self.tools and self.raw:
            raise InvalidRequest("`tools` go through the chat template, which `raw` skips", field="tools")


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
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    logit_bias: dict[str, float] | None = None
    tools: list[Any] | None = None  # gateway/tools.py
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    user: str | None = None

    def validate(self) -> None:
        if self.n != 1:
            raise InvalidSamplingParams("only n=1 is supported", field="n")
        for field in ("logit_bias",):
            if getattr(self, field):
                raise InvalidSamplingParams(f"`{field}` is not supported", field=field)
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("`top_logprobs` needs `logprobs: true`", field="top_logprobs")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("`stream_options` needs `stream: true`", field="stream_options")

    @property
    def stop_list(self) -> list[str]:
        """`stop` as a list (each string non-empty and bounded by the schema)."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(msgspec.Struct, frozen=True):
    """OpenAI `POST /v1/completions` (legacy text completion, what scoring clients use).

    `prompt` is a string, a list of strings, a list of token ids, or a list of such lists;
    each prompt is one choice (`index` in order). `echo` puts the prompt before the
    completion (text, and tokens in `logprobs`); `max_tokens` 0 with `echo` scores the
    prompt only."""

    model: str
    prompt: str | list[Any]
    max_tokens: Annotated[int, Meta(ge=0, le=MAX_TOKENS_LIMIT)] = 16
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    n: Annotated[int, Meta(ge=1)] = 1
    best_of: Annotated[int, Meta(ge=1)] | None = None
    stop: StopString | Annotated[list[StopString], Meta(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: Seed | None = None
    echo: bool = False
    logprobs: TopLogprobs | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    logit_bias: dict[str, float] | None = None
    suffix: str | None = None
    user: str | None = None

    def validate(self) -> None:
        if self.n != 1:
            raise InvalidSamplingParams("only n=1 is supported", field="n")
        if self.best_of not in (None, 1):
            raise InvalidSamplingParams("only best_of=1 is supported", field="best_of")
        for field in ("logit_bias", "suffix"):
            if getattr(self, field):
                raise InvalidSamplingParams(f"`{field}` is not supported", field=field)
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("`stream_options` needs `stream: true`", field="stream_options")
        self.prompts()

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each a string or a list of token ids (non-empty; at most `MAX_PROMPTS`)."""
        p = self.prompt
        if isinstance(p, str):
            items: list[Any] = [p]
        elif p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            items = [p]
        else:
            items = list(p)
        if not 1 <= len(items) <= MAX_PROMPTS:
            raise InvalidRequest(f"`prompt` must hold 1..{MAX_PROMPTS} prompts", field="prompt")
        for i, item in enumerate(items):
            ok = (isinstance(item, str) and item) or (
                isinstance(item, list) and item and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                        for t in item))
            if not ok:
                raise InvalidRequest("each prompt must be a non-empty string or a non-empty list of token ids",
                                     field=f"prompt[{i}]")
        return items

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


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


def plain_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: text parts joined, anything else refused; an
    assistant's `tool_calls` with their arguments as objects (what templates `tojson`), a tool
    result with its `tool_call_id` (and `name` when given)."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if m.content is None or isinstance(m.content, str):
            text = m.content
        else:
            if any(p.type != "text" or p.text is None for p in m.content):
                raise InvalidRequest("only text content parts are supported", field=f"messages[{i}].content")
            text = "".join(p.text or "" for p in m.content)
        if text is None and not (m.role == "assistant" and m.tool_calls):
            raise InvalidRequest("`content` is required", field=f"messages[{i}].content")
        msg: dict[str, Any] = {"role": m.role, "content": text}
        if m.tool_calls:
            if m.role != "assistant":
                raise InvalidRequest("only assistant messages carry `tool_calls`", field=f"messages[{i}].tool_calls")
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                                 for c in m.tool_calls]
        if m.role == "tool":
            if m.tool_call_id is None:
                raise InvalidRequest("a tool message needs `tool_call_id`", field=f"messages[{i}].tool_call_id")
            msg["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out


def _arguments(text: str) -> Any:
    """A call's arguments as an object for the template (the text itself when it is not JSON)."""
    try:
        return msgspec.json.decode(text)
    except msgspec.DecodeError:
        return text
