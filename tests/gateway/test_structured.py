"""Structured output through the gateway: `response_format` with the official `openai` client
(create, streamed, `parse` with a pydantic model, a cut output said to be "length") and Workers
AI's JSON mode; invalid schemas are typed 400s naming `response_format`."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from tests.gateway.conftest import MODEL, Gateway, wait_pages_free

SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["colour", "count"], "additionalProperties": False}


class Pick(pydantic.BaseModel):
    colour: Literal["red", "green", "blue"]  # bounded: the random tiny model would ramble in a free string
    count: int = pydantic.Field(ge=0, le=9)


def _client(gateway: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=gateway.account.token, max_retries=0)


def test_openai_json_schema_json_object_streamed_and_cut(gateway: Gateway) -> None:
    client = _client(gateway)
    messages = [{"role": "user", "content": "Pick a colour and a count."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}}
    for seed in range(3):
        out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, seed=seed,
                                             response_format=fmt)
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, seed=0,
                                                 response_format=fmt, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)
    obj = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, seed=1, temperature=0.7,
                                         response_format={"type": "json_object"})
    choice = obj.choices[0]
    assert (isinstance(json.loads(choice.message.content), dict) if choice.finish_reason == "stop"
            else choice.finish_reason == "length" and choice.message.content.startswith("{"))
    cut = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, seed=0, response_format=fmt)
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.content.startswith('{"')
    wait_pages_free(gateway.worker.engine)


def test_openai_parse_with_a_pydantic_model(gateway: Gateway) -> None:
    client = _client(gateway)
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    out = parse(model=MODEL, messages=[{"role": "user", "content": "Pick."}], max_tokens=60, seed=2,
                response_format=Pick)
    assert isinstance(out.choices[0].message.parsed, Pick)
    with pytest.raises(openai.LengthFinishReasonError):
        parse(model=MODEL, messages=[{"role": "user", "content": "Pick."}], max_tokens=2, response_format=Pick)
    wait_pages_free(gateway.worker.engine)


def test_invalid_response_formats_are_typed_400s(gateway: Gateway) -> None:
    client = _client(gateway)
    for fmt in ({"type": "xml"}, {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
                {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                           response_format=fmt)
        assert (info.value.body or {}).get("param", "").startswith("response_format"), info.value.body


def test_workers_json_mode_returns_the_object(gateway: Gateway) -> None:
    url = f"{gateway.url}/client/v4/accounts/{gateway.account.tenant_id}/ai/run/{MODEL}"
    auth = {"authorization": f"Bearer {gateway.account.token}"}
    body = {"messages": [{"role": "user", "content": "Pick."}], "max_tokens": 60, "seed": 4,
            "response_format": {"type": "json_schema", "json_schema": SCHEMA}}
    r = httpx.post(url, json=body, headers=auth, timeout=60)
    assert r.status_code == 200, r.text
    jsonschema.validate(r.json()["result"]["response"], SCHEMA)
    r = httpx.post(url, json={**body, "max_tokens": 2}, headers=auth, timeout=60)
    assert isinstance(r.json()["result"]["response"], str) and r.json()["messages"][0]["code"] == 3042
    r = httpx.post(url, json={**body, "response_format": {"type": "json_schema", "json_schema": {"type": 5}}},
                   headers=auth, timeout=60)
    assert r.status_code == 400 and not r.json()["success"]
    wait_pages_free(gateway.worker.engine)
