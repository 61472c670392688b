"""`tool_choice` "required" and named functions, and reasoning_content, through the real gateway and
worker with the official `openai` client (a Qwen2.5-style template, the hermes parser; a template that
opens a think block for reasoning). The tiny random model calls tools only because the grammar makes
it: every call it makes must parse and validate. Also: what a prefill/decode pair refuses, and
Workers AI `tools` on the Workers route."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from backend.async_engine import AsyncEngine
from backend.decode_coordinator import DecodeCoordinator
from backend.kv_transfer import HttpKVTransport
from backend.sampling_params import GRAMMAR_KINDS
from backend.worker import create_worker_app
from gateway.app import create_gateway_app
from gateway.config import GatewayConfig, ModelRoute
from gateway.reasoning_parsers import REASONING_PARSERS, split_reasoning
from tests.backend.servers import serve_in_thread
from tests.gateway.conftest import MODEL, Gateway, Worker, gateway_config, make_account, tiny_engine, wait_pages_free

# the worker must accept Lark grammars (GrammarSpec kind "lark", backend/sampling_params.py GRAMMAR_KINDS)
needs_lark = pytest.mark.skipif("lark" not in GRAMMAR_KINDS, reason="the worker does not take Lark grammars yet")

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Rome"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 9},
                                            "metric": {"type": "boolean"}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "list_files", "description": "Files here"}}]
SCHEMAS = {"get_weather": WEATHER, "list_files": {"type": "object", "properties": {}, "additionalProperties": False}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture
def tool_gateway(worker: Worker, tiny_tool_chat_dir: Path, redis_url: str) -> Iterator[Gateway]:
    app = create_gateway_app(gateway_config(tiny_tool_chat_dir, [worker.url], redis_url, keepalive_s=5.0))
    with serve_in_thread(app) as url:
        yield Gateway(url, make_account(redis_url), worker)


def _client(gateway: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=gateway.account.token, max_retries=0)


def _valid(calls) -> list[tuple[str, dict]]:
    out = []
    for call in calls:
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append((call.function.name, args))
    return out


def _streamed_calls(chunks) -> tuple[list[dict], str, str]:
    """Streamed tool calls joined as a client joins them (id/name first, then argument fragments),
    the joined content and the last finish_reason."""
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            if tc.id is not None:
                assert tc.index not in calls and tc.function.name and tc.function.arguments == ""
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
            else:
                calls[tc.index]["arguments"] += tc.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    return [calls[i] for i in sorted(calls)], content, finish


@needs_lark
def test_named_and_required_calls_always_parse_and_validate(tool_gateway: Gateway) -> None:
    client = _client(tool_gateway)
    named = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                           max_tokens=64, temperature=0)
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert [n for n, _ in _valid(choice.message.tool_calls)] == ["get_weather"]
    assert choice.message.tool_calls[0].id.startswith("call_")
    one = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=False, max_tokens=64, temperature=0)
    assert one.choices[0].finish_reason == "tool_calls" and len(_valid(one.choices[0].message.tool_calls)) == 1
    for seed in range(3):  # sampled: one or more calls, each valid, or cut by max_tokens in the last one
        out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                             max_tokens=96, temperature=1.0, seed=seed)
        choice = out.choices[0]
        if choice.finish_reason == "tool_calls":
            assert len(_valid(choice.message.tool_calls)) >= 1
        else:
            assert choice.finish_reason == "length"
    wait_pages_free(tool_gateway.worker.engine)


@needs_lark
def test_streamed_calls_join_to_the_non_streamed_ones(tool_gateway: Gateway) -> None:
    client = _client(tool_gateway)
    for choice in (NAMED, "required"):
        kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
                  max_tokens=64, temperature=0)
        whole = client.chat.completions.create(**kw).choices[0]
        calls, content, finish = _streamed_calls(client.chat.completions.create(**kw, stream=True))
        assert finish == whole.finish_reason == "tool_calls" and content == ""
        assert [(c["name"], c["arguments"]) for c in calls] == \
            [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    wait_pages_free(tool_gateway.worker.engine)


def test_tool_choice_refusals_are_typed_400s(tool_gateway: Gateway) -> None:
    client = _client(tool_gateway)
    bad = [(dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
            "tool_choice.function.name"),
           (dict(tool_choice="required"), "tool_choice"),
           (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "response_format")]
    for kw, param in bad:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, **kw)
        assert (info.value.body or {}).get("param") == param, info.value.body


THINK_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")


@pytest.fixture(scope="module")
def think_dir(tmp_path_factory: pytest.TempPathFactory, tiny_chat_dir: Path) -> Path:
    """`tiny_chat_dir` with a template that opens a think block at the end of the prompt."""
    import shutil

    path = tmp_path_factory.mktemp("tiny-think") / "m"
    shutil.copytree(tiny_chat_dir, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = THINK_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def _gateway(model_dir: Path, worker: Worker, redis_url: str, **route) -> contextlib.AbstractContextManager[str]:
    config = GatewayConfig(models=[ModelRoute(MODEL, str(model_dir), [worker.url], max_model_len=512, **route)],
                           redis_url=redis_url, keepalive_s=5.0)
    return serve_in_thread(create_gateway_app(config))


def test_reasoning_content_from_a_prompt_that_opened_a_think_block(worker: Worker, think_dir: Path,
                                                                    redis_url: str) -> None:
    account = make_account(redis_url)
    kw = dict(model=MODEL, messages=ASK, max_tokens=24, temperature=0)
    with _gateway(think_dir, worker, redis_url, reasoning_parser="none") as url:
        plain = openai.OpenAI(base_url=f"{url}/v1", api_key=account.token).chat.completions.create(**kw)
    text = plain.choices[0].message.content
    want_reasoning, want_content = split_reasoning(REASONING_PARSERS["qwen3"](in_think=True), text)
    assert want_reasoning  # the model starts inside the block: its text is reasoning until a </think>
    with _gateway(think_dir, worker, redis_url, reasoning_parser="qwen3") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=account.token, max_retries=0)
        message = client.chat.completions.create(**kw).choices[0].message
        assert message.reasoning_content == want_reasoning and message.content == want_content
        chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == want_reasoning
    assert "".join(d.content or "" for d in deltas) == want_content
    wait_pages_free(worker.engine)


def test_workers_route_takes_tools_in_both_shapes(tool_gateway: Gateway) -> None:
    url = f"{tool_gateway.url}/client/v4/accounts/{tool_gateway.account.tenant_id}/ai/run/{MODEL}"
    headers = {"Authorization": f"Bearer {tool_gateway.account.token}"}
    bare = httpx.post(url, headers=headers, json={"messages": ASK, "max_tokens": 4, "temperature": 0}).json()
    workers_shape = [{"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}]
    outs = [httpx.post(url, headers=headers, json={"messages": ASK, "tools": tools, "max_tokens": 4,
                                                    "temperature": 0}).json() for tools in (workers_shape, TOOLS[:1])]
    for out in outs:
        assert out["success"] and out["result"]["tool_calls"] == []  # the random model writes no call
        assert out["result"]["usage"]["prompt_tokens"] > bare["result"]["usage"]["prompt_tokens"] + 20
    assert outs[0]["result"]["usage"] == outs[1]["result"]["usage"]  # the same prompt either way
    with httpx.stream("POST", url, headers=headers, json={"messages": ASK, "tools": workers_shape, "max_tokens": 4,
                                                           "temperature": 0, "stream": True}) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    assert "".join(e["response"] for e in events) == outs[0]["result"]["response"]
    assert events[-1]["tool_calls"] == [] and "usage" in events[-1]
    bad = httpx.post(url, headers=headers, json={"messages": ASK, "tools": [{"description": "no name"}]})
    assert bad.status_code == 400 and not bad.json()["success"]
    wait_pages_free(tool_gateway.worker.engine)


@pytest.fixture
def pd_gateway(tiny_tool_chat_dir: Path, tiny_chat_dir: Path, redis_url: str) -> Iterator[Gateway]:
    """A gateway in front of a decode worker whose KV comes from a prefill worker (one pair)."""
    with contextlib.ExitStack() as stack:
        prefill = stack.enter_context(serve_in_thread(create_worker_app(AsyncEngine(tiny_engine(tiny_chat_dir)),
                                                                        MODEL, role="prefill")))
        decode_engine = tiny_engine(tiny_chat_dir)
        adec = AsyncEngine(decode_engine)
        coord = DecodeCoordinator(adec, [prefill], HttpKVTransport(), reserve_timeout_s=1.0, transfer_timeout_s=10.0)
        decode = stack.enter_context(serve_in_thread(create_worker_app(adec, MODEL, role="decode",
                                                                       coordinator=coord)))
        app = create_gateway_app(gateway_config(tiny_tool_chat_dir, [decode], redis_url, keepalive_s=5.0))
        url = stack.enter_context(serve_in_thread(app))
        yield Gateway(url, make_account(redis_url), Worker(decode, decode_engine))


def test_a_prefill_decode_pair_refuses_logprobs_and_grammars_typed(pd_gateway: Gateway) -> None:
    """The prefill worker samples the first token, without logprobs or a grammar mask: a pair refuses
    both (backend/decode_coordinator.py), as a typed 400 naming the field, before any KV moves."""
    client = _client(pd_gateway)
    ok = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens == 3
    refused = [(dict(logprobs=True), ("logprobs",)),
               (dict(response_format={"type": "json_object"}), ("response_format",)),
               (dict(tools=TOOLS, tool_choice=NAMED), ("tool_choice",))]
    for kw, params in refused:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3, **kw)
        assert (info.value.body or {}).get("param") in params, info.value.body
    wait_pages_free(pd_gateway.worker.engine)
