"""Tool-call parsers on recorded outputs of each family (well-formed, malformed, cut short), read
whole (the non-streamed message) and streamed in random chunkings: streamed, the argument
fragments join to exactly the arguments of the whole reading, and flow before a call closes."""

from __future__ import annotations

import json
import random

import pytest

from gateway.tool_parsers import TOOL_PARSERS, ContentDelta, ToolCallDelta, tool_parser_for
from gateway.tool_parsers.base import collect
from gateway.tools import ToolCallStream, finish_reason_with_tools, tool_message

WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]

# (parser, model output, expected content, expected [(name, arguments object, id or None)])
RECORDED = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
               '</tool_call>', "Let me check.\n", [("get_weather", {"city": "Paris", "days": 2}, None)]),
    ("hermes", '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": '
               '{"x": [1, {"y": "</tool"}]}}\n</tool_call>', "", [("a", {}, None), ("b", {"x": [1, {"y": "</tool"}]}, None)]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}', "",  # EOS before the closing tag
     [("get_weather", {"city": "Oslo"}, None)]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": ', '<tool_call>\n{"name": "get_weather", '
               '"arguments": {"city": ', []),  # cut by max_tokens: plain content
    ("hermes", '<tool_call>not json</tool_call> then text', "<tool_call>not json</tool_call> then text", []),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ("hermes", "no calls here, just < and <tool_ text", "no calls here, just < and <tool_ text", []),
    ("glm45", "I will look.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>12</arg_value>\n"
              "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>", "I will look.",
     [("get_weather", {"city": "12", "days": 3}, None)]),  # the schema says city is a string
    ("glm45", "<tool_call>list_files</tool_call>", "", [("list_files", {}, None)]),  # zero arguments
    ("glm45", "<tool_call>f\n<arg_key>o</arg_key>\n<arg_value>{\"k\": [1, 2]}</arg_value>\n</tool_call>"
              "<tool_call>g\n<arg_key>s</arg_key><arg_value>two words</arg_value></tool_call>", "",
     [("f", {"o": {"k": [1, 2]}}, None), ("g", {"s": "two words"}, None)]),
    ("glm45", "<tool_call>f\n<arg_key>o</arg_key>junk</tool_call>", "<tool_call>f\n<arg_key>o</arg_key>junk</tool_call>",
     []),
    ("glm45", "<tool_call>\n</tool_call>", "<tool_call>\n</tool_call>", []),
    ("kimi_k2", "Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_"
                'begin|>{"city": "Rome"}<|tool_call_end|><|tool_call_begin|>functions.list_files:1<|tool_call_argument'
                "_begin|>{}<|tool_call_end|><|tool_calls_section_end|>", "Checking.",
     [("get_weather", {"city": "Rome"}, "functions.get_weather:0"), ("list_files", {}, "functions.list_files:1")]),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{bad"
                "<|tool_call_end|><|tool_calls_section_end|>", "<|tool_calls_section_begin|><|tool_call_begin|>"
                "functions.f:0<|tool_call_argument_begin|>{bad<|tool_call_end|><|tool_calls_section_end|>", []),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}",
     "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}", []),
]


# streamed, a call cut inside its arguments has already gone out: (name, its arguments as far as they came)
CUT_STREAMED = {
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": ': [("get_weather", '{"city": ')],
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}": [("f", "{}")],
}


def chunkings(text: str, rng: random.Random, n: int = 25) -> list[list[str]]:
    out = [[text], list(text)]
    for _ in range(n):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return out


def streamed(name: str, pieces: list[str]) -> list:
    parser = TOOL_PARSERS[name](WEATHER)
    return [ev for piece in pieces for ev in parser.feed(piece)] + parser.finish()


@pytest.mark.parametrize("name,text,content,calls", RECORDED)
def test_recorded_outputs_whole_and_in_any_chunking(name: str, text: str, content: str, calls: list) -> None:
    got_content, whole = collect(TOOL_PARSERS[name](WEATHER).parse_whole(text))
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in whole] == [(n, a) for n, a, _ in calls]
    for call, (_, _, want_id) in zip(whole, calls, strict=True):
        assert call.id == want_id if want_id else call.id.startswith("call_")
    rng = random.Random(hash(text) & 0xFFFF)
    for pieces in chunkings(text, rng):
        events = streamed(name, pieces)
        got_content, got_calls = collect(events)
        if text in CUT_STREAMED:
            assert [(c.name, c.arguments) for c in got_calls] == CUT_STREAMED[text], pieces
            continue
        assert got_content == content, pieces
        # the fragments join to exactly the final (non-streamed) arguments, whatever the chunking
        assert [(c.name, c.arguments) for c in got_calls] == [(c.name, c.arguments) for c in whole], pieces
        for call, (_, _, want_id) in zip(got_calls, calls, strict=True):
            assert call.id == want_id if want_id else call.id.startswith("call_")
        # every call opens with its id and name before any argument fragment
        starts = [ev for ev in events if isinstance(ev, ToolCallDelta) and ev.id is not None]
        assert [ev.index for ev in starts] == list(range(len(calls)))
        assert all(ev.arguments == "" for ev in starts)
        assert all(ev.text for ev in events if isinstance(ev, ContentDelta))


LONG = {"city": "Paris, \"the\" {city} of light", "days": 12, "notes": ["a", {"b": None}], "unicode": "\u00e9\u2603"}


@pytest.mark.parametrize("name,text", [
    ("hermes", "<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": LONG}) + "\n</tool_call>"),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:3<|tool_call_argument_begin|>"
                + json.dumps(LONG) + "<|tool_call_end|><|tool_calls_section_end|>"),
    ("glm45", "<tool_call>get_weather\n" + "".join(f"<arg_key>{k}</arg_key>\n<arg_value>"
              f"{v if isinstance(v, str) else json.dumps(v)}</arg_value>\n" for k, v in LONG.items()) + "</tool_call>"),
])
def test_arguments_flow_as_they_arrive(name: str, text: str) -> None:
    """Fed a character at a time, a call's arguments go out in many fragments, most of them before
    the block's closing marker arrives, and join to the whole reading's arguments."""
    parser = TOOL_PARSERS[name](WEATHER)
    end = text.rindex(parser.END)
    fragments_before_end, events = 0, []
    for i, ch in enumerate(text):
        new = parser.feed(ch)
        events += new
        if i < end:
            fragments_before_end += sum(1 for ev in new if isinstance(ev, ToolCallDelta) and ev.arguments)
    events += parser.finish()
    _, calls = collect(events)
    _, whole = collect(TOOL_PARSERS[name](WEATHER).parse_whole(text))
    assert [c.arguments for c in calls] == [c.arguments for c in whole] and json.loads(calls[0].arguments) == LONG
    assert fragments_before_end >= (len(LONG) if name == "glm45" else 10)
    assert "".join(ev.arguments for ev in events if isinstance(ev, ToolCallDelta))[-1] == "}"



def test_chunk_deltas_and_message_as_openai_shapes_them() -> None:
    text = 'Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    stream = ToolCallStream(TOOL_PARSERS["hermes"](WEATHER))
    deltas = [d for piece in (text[:9], text[9:30], text[30:]) for d in stream.feed(piece)] + stream.finish()
    assert deltas[0] == {"content": "Sure."}
    head = deltas[1]["tool_calls"][0]
    assert head["index"] == 0 and head["type"] == "function" and head["id"].startswith("call_")
    assert head["function"] == {"name": "get_weather", "arguments": ""}
    args = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas[2:])
    assert json.loads(args) == {"city": "Paris"} and stream.called
    assert finish_reason_with_tools("stop", stream.called) == "tool_calls"
    assert finish_reason_with_tools("length", stream.called) == "length"
    message = tool_message(TOOL_PARSERS["hermes"](WEATHER), text)
    assert message["content"] == "Sure." and message["tool_calls"][0]["function"]["name"] == "get_weather"
    only_call = tool_message(TOOL_PARSERS["hermes"](), text[5:])
    assert only_call["content"] is None and len(only_call["tool_calls"]) == 1
    plain = tool_message(TOOL_PARSERS["hermes"](), "<tool_call>{oops")
    assert plain == {"role": "assistant", "content": "<tool_call>{oops"}


def test_parser_chosen_from_config_or_flag() -> None:
    assert tool_parser_for({"model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"]}) is TOOL_PARSERS["glm45"]
    assert tool_parser_for({"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"]}) \
        is TOOL_PARSERS["kimi_k2"]
    assert tool_parser_for({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}) is TOOL_PARSERS["hermes"]
    assert tool_parser_for({"model_type": "llama"}, "glm45") is TOOL_PARSERS["glm45"]
    with pytest.raises(Exception, match="unknown tool parser"):
        tool_parser_for({}, "nope")
