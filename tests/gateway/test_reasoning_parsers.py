"""Reasoning parsers on recorded outputs of each rule (closed, opened by the prompt, cut, no think
block, a tool call with no `</think>`, malformed), fed whole and in random chunkings: the split into
reasoning_content and content never depends on the chunking, and together with the tool parsers
(`ChatOutput`) no call markup lands in either."""

from __future__ import annotations

import json
import random

import pytest

from gateway.chat_output import ChatOutput, chat_message
from gateway.reasoning_parsers import REASONING_PARSERS, ReasoningDelta, reasoning_parser_for, split_reasoning
from gateway.tool_parsers import TOOL_PARSERS, ContentDelta
from tests.gateway.test_tool_parsers import WEATHER, chunkings

# (rule, prompt opened <think>, tool parser's start marker, output, reasoning, content)
RECORDED = [
    ("qwen3", False, None, "<think>\nThe user greets me.\n</think>\n\nHello!", "\nThe user greets me.\n", "Hello!"),
    ("qwen3", False, None, "  <think>short</think>Hi", "short", "Hi"),
    ("qwen3", False, None, "Hello, no thinking here. <think>x</think>", "", "Hello, no thinking here. <think>x</think>"),
    ("qwen3", True, None, "Reasoning right away.</think>\n\nAnswer.", "Reasoning right away.", "Answer."),
    ("qwen3", True, None, "Cut while still thinking about <thi", "Cut while still thinking about <thi", ""),
    ("qwen3", False, None, "<think></think>\n\nEmpty block.", "", "Empty block."),
    ("qwen3", False, None, "<think>a</think>b</think>c", "a", "b</think>c"),  # one block only
    ("qwen3", False, None, "<thinking>not the marker</thinking>", "", "<thinking>not the marker</thinking>"),
    ("deepseek_r1", False, None, "No opening tag, still reasoning.</think>Answer", "No opening tag, still reasoning.",
     "Answer"),
    ("deepseek_r1", False, None, "<think>\nwith the tag</think>A", "\nwith the tag", "A"),
    ("deepseek_r1", False, None, "never closed", "never closed", ""),
    ("glm45", False, "<tool_call>", "<think>I should look it up.<tool_call>get_weather\n<arg_key>city</arg_key>\n"
     "<arg_value>Paris</arg_value>\n</tool_call>", "I should look it up.",
     "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"),
    ("kimi_k2", False, None, "<think>Use the tool.<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
     "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>", "Use the tool.",
     "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}<|tool_call_end|>"
     "<|tool_calls_section_end|>"),
    ("glm45", False, None, "", "", ""),
]


@pytest.mark.parametrize("rule,in_think,tool_start,text,reasoning,content", RECORDED)
def test_recorded_outputs_split_the_same_in_any_chunking(rule: str, in_think: bool, tool_start: str | None,
                                                         text: str, reasoning: str, content: str) -> None:
    assert split_reasoning(REASONING_PARSERS[rule](in_think, tool_start), text) == (reasoning, content)
    rng = random.Random(hash(text) & 0xFFFF)
    for pieces in chunkings(text, rng) if len(text) > 1 else [[text]]:
        parser = REASONING_PARSERS[rule](in_think, tool_start)
        events = [ev for piece in pieces for ev in parser.feed(piece)] + parser.finish()
        assert all(ev.text for ev in events)
        got = ("".join(ev.text for ev in events if isinstance(ev, ReasoningDelta)),
               "".join(ev.text for ev in events if isinstance(ev, ContentDelta)))
        assert got == (reasoning, content), pieces


CALLS = {
    "hermes": 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "glm45": "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
    "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
               '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>',
}


@pytest.mark.parametrize("family", sorted(CALLS))
@pytest.mark.parametrize("closed", [True, False])
def test_a_call_after_reasoning_is_a_call_with_or_without_the_closing_tag(family: str, closed: bool) -> None:
    text = "<think>The weather tool, for Paris." + ("</think>\n\n" if closed else "") + CALLS[family]
    tools = TOOL_PARSERS[family]

    def fresh() -> tuple:
        rule = REASONING_PARSERS[family if family != "hermes" else "qwen3"]
        return rule(False, tools.START), tools(WEATHER)

    message = chat_message(*fresh(), text)
    lead = "Sure.\n" if family == "hermes" else ""  # text before the call: content after </think>, else reasoning
    assert message["reasoning_content"] == "The weather tool, for Paris." + ("" if closed else lead)
    assert message["content"] == ((lead if closed else "") or None)
    call = message["tool_calls"][0]["function"]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
    for pieces in chunkings(text, random.Random(7), n=10):
        out = ChatOutput(*fresh())
        deltas = [d for piece in pieces for d in out.feed(piece)] + out.finish()
        reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
        content = "".join(d.get("content") or "" for d in deltas)
        arguments = "".join(tc["function"]["arguments"] for d in deltas for tc in d.get("tool_calls", []))
        assert reasoning == message["reasoning_content"] and content == (message["content"] or "")
        assert arguments == call["arguments"] and out.called
        for marker in (*tools.MARKERS, "<think>", "</think>"):  # no markup leaks into either text
            assert marker not in reasoning and marker not in content


def test_chat_message_without_think_block_or_parsers() -> None:
    qwen = REASONING_PARSERS["qwen3"]
    assert chat_message(qwen(), None, "Plain answer.") == {"role": "assistant", "reasoning_content": None,
                                                           "content": "Plain answer."}
    assert chat_message(None, None, "<think>x</think>y") == {"role": "assistant", "content": "<think>x</think>y"}
    cut = chat_message(qwen(), TOOL_PARSERS["hermes"](WEATHER), '<think>a</think><tool_call>\n{"name": "get_we')
    assert cut == {"role": "assistant", "reasoning_content": "a", "content": '<tool_call>\n{"name": "get_we'}


def test_rule_chosen_from_config_only_where_certain_or_from_the_flag() -> None:
    assert reasoning_parser_for({"model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"]}) \
        is REASONING_PARSERS["glm45"]
    assert reasoning_parser_for({"model_type": "qwen3"}) is REASONING_PARSERS["qwen3"]
    assert reasoning_parser_for({"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"]}) \
        is REASONING_PARSERS["kimi_k2"]
    for config in ({"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"]},
                   {"model_type": "llama"}, {"model_type": "qwen2"}, {}):
        assert reasoning_parser_for(config) is None  # R1 and V3 share an architecture: not certain
    assert reasoning_parser_for({"model_type": "llama"}, "deepseek_r1") is REASONING_PARSERS["deepseek_r1"]
    assert reasoning_parser_for({"model_type": "qwen3"}, "none") is None
    with pytest.raises(Exception, match="unknown reasoning parser"):
        reasoning_parser_for({}, "o1")
