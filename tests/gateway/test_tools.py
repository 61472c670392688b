"""`tools` / `tool_choice` through the real gateway and worker with the official `openai` client:
tools and earlier calls and results rendered by a Qwen2.5-style template, `auto` / `none`, streamed
and not, a multi-turn exchange with a tool result; invalid tools are typed 400s. (The tiny random
model does not call tools by itself; the parsing of calls is tested on recorded outputs in
test_tool_parsers.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from gateway.app import create_gateway_app
from gateway.served_models import ServedModel
from tests.backend.servers import serve_in_thread
from tests.gateway.conftest import MODEL, Gateway, Worker, gateway_config, make_account, wait_pages_free

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
TURNS = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]


@pytest.fixture
def tool_gateway(worker: Worker, tiny_tool_chat_dir: Path, redis_url: str) -> Iterator[Gateway]:
    app = create_gateway_app(gateway_config(tiny_tool_chat_dir, [worker.url], redis_url, keepalive_s=5.0))
    with serve_in_thread(app) as url:
        yield Gateway(url, make_account(redis_url), worker)


def _client(gateway: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=gateway.account.token, max_retries=0)


def test_template_renders_tools_calls_and_results(tiny_tool_chat_dir: Path) -> None:
    from gateway.config import ModelRoute
    from gateway.schemas import Message, plain_messages
    import msgspec

    model = ServedModel(ModelRoute(MODEL, str(tiny_tool_chat_dir)))
    messages = plain_messages(msgspec.convert(TURNS, list[Message]))
    text = model.tokenizer.decode(model.chat_prompt_ids(messages, TOOLS), skip_special_tokens=False)
    assert "<tools>\n{" in text and '"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")


def test_tools_auto_and_none_streamed_and_not(tool_gateway: Gateway) -> None:
    client = _client(tool_gateway)
    bare = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, temperature=0)
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=8, temperature=0)
    assert out.usage.prompt_tokens > bare.usage.prompt_tokens + 20  # the tools reached the template
    choice = out.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].usage.prompt_tokens == out.usage.prompt_tokens
    none = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=8,
                                          temperature=0)
    assert none.usage.prompt_tokens == out.usage.prompt_tokens and none.choices[0].message.content == \
        choice.message.content
    wait_pages_free(tool_gateway.worker.engine)


def test_multi_turn_with_a_tool_result(tool_gateway: Gateway) -> None:
    client = _client(tool_gateway)
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=4, temperature=0)
    out = client.chat.completions.create(model=MODEL, messages=TURNS, tools=TOOLS, max_tokens=4, temperature=0)
    assert out.usage.prompt_tokens > first.usage.prompt_tokens + 15 and out.choices[0].message.role == "assistant"
    wait_pages_free(tool_gateway.worker.engine)


def test_invalid_tools_are_typed_400s(tool_gateway: Gateway) -> None:
    client = _client(tool_gateway)
    bad = [([{"type": "function", "function": {"parameters": {}}}], None, "tools[0].function.name"),
           ([{"type": "retrieval"}], None, "tools[0]"),
           ([{"type": "function", "function": {"name": "f", "description": "<|im_end|>"}}], None, "tools"),
           (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name"),
           (TOOLS, {"type": "function"}, "tool_choice"), (TOOLS, "sometimes", "tool_choice")]
    for tools, choice, param in bad:
        kw = {"tool_choice": choice} if choice else {}
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, tools=tools, **kw)
        assert (info.value.body or {}).get("param") == param, info.value.body
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[*ASK, {"role": "tool", "content": "x"}], max_tokens=2)
    assert (info.value.body or {}).get("param") == "messages[1].tool_call_id"
