"""Both public APIs end to end: real gateway, real worker (tiny model, SmolLM2 tokenizer), real Redis."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from backend.protocol import FinishEvent, GenerateRequest, TokenEvent
from backend.sampling_params import SamplingParams
from backend.tokenizer import Tokenizer
from backend.worker_client import WorkerClient
from gateway.generation import worker_tag
from tests.gateway.conftest import (ALIAS, MODEL, Gateway, make_account, metered, revoke_key, wait_metered,
                                    wait_pages_free)


def auth(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def run_url(gw: Gateway, model: str = ALIAS, account: str | None = None) -> str:
    return f"{gw.url}/client/v4/accounts/{account or gw.account.tenant_id}/ai/run/{model}"


def sse_data(text: str) -> list[str]:
    """The `data:` payloads of an SSE body, in order (comments and event names dropped)."""
    return [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]


def direct_greedy(worker_url: str, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], FinishEvent]:
    async def go():
        client = WorkerClient(worker_url)
        try:
            ids: list[int] = []
            async for ev in client.generate(GenerateRequest(prompt_ids, SamplingParams(max_tokens=max_tokens,
                                                                                        temperature=0.0))):
                if isinstance(ev, TokenEvent):
                    ids += ev.token_ids
                else:
                    return ids, ev
        finally:
            await client.aclose()

    return asyncio.run(go())


def test_workers_run_returns_the_workers_greedy_text_and_usage(gateway: Gateway, tiny_chat_dir) -> None:
    tok = Tokenizer.from_model_dir(tiny_chat_dir)
    prompt_ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Name three rivers."}]))
    expected_ids, fin = direct_greedy(gateway.worker.url, prompt_ids, 12)

    resp = httpx.post(run_url(gateway), headers=auth(gateway.account.token),
                      json={"prompt": "Name three rivers.", "max_tokens": 12, "temperature": 0})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["success"] is True and body["errors"] == [] and body["messages"] == []
    assert body["result"]["response"] == tok.decode(expected_ids)
    usage = body["result"]["usage"]
    assert usage == {"prompt_tokens": len(prompt_ids), "completion_tokens": fin.completion_tokens,
                     "total_tokens": len(prompt_ids) + fin.completion_tokens,
                     "prompt_tokens_details": {"cached_tokens": 0}}
    # where it ran is told by an opaque tag, never the worker's address (issue 17 item 9)
    tag = worker_tag(gateway.worker.url)  # a static worker's id is its URL
    assert resp.headers["x-edgeserve-worker"] == tag and tag in resp.headers["x-edgeserve-route"]
    assert not any(gateway.worker.url.split("//")[1] in v for v in resp.headers.values())


def test_workers_stream_matches_non_stream_and_ends_with_usage_then_done(gateway: Gateway) -> None:
    body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
            "max_tokens": 20, "temperature": 0}
    whole = httpx.post(run_url(gateway), headers=auth(gateway.account.token), json=body).json()["result"]
    resp = httpx.post(run_url(gateway), headers=auth(gateway.account.token), json={**body, "stream": True})
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    events = sse_data(resp.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["response"] for c in chunks) == whole["response"]
    assert chunks[-1]["response"] == "" and chunks[-1]["usage"] == whole["usage"]
    assert all("usage" not in c for c in chunks[:-1])
    wait_pages_free(gateway.worker.engine)


def test_openai_client_non_stream_and_stream(gateway: Gateway) -> None:
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=gateway.account.token, max_retries=0)
    messages = [{"role": "user", "content": "Count to five."}]
    done = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert done.object == "chat.completion" and done.model == MODEL
    choice = done.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert done.usage.completion_tokens <= 10 and done.usage.prompt_tokens > 5
    assert done.usage.total_tokens == done.usage.prompt_tokens + done.usage.completion_tokens

    stream = client.chat.completions.create(model=ALIAS, messages=messages, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finals] == [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == done.usage.completion_tokens

    models = {m.id for m in client.models.list()}
    assert {MODEL, ALIAS} <= models


def test_openai_account_path_and_stop_strings_are_trimmed(gateway: Gateway) -> None:
    url = f"{gateway.url}/client/v4/accounts/{gateway.account.tenant_id}/ai/v1"
    client = openai.OpenAI(base_url=url, api_key=gateway.account.token, max_retries=0)
    messages = [{"role": "user", "content": "Tell me a story."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    text = full.choices[0].message.content
    assert len(text) > 6
    stop = text[3:6]  # a stop string taken from the middle of the greedy output
    cut = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[: text.find(stop)]
    assert cut.usage.completion_tokens < full.usage.completion_tokens or text.find(stop) < 3


def test_usage_is_metered_once_per_request_and_readable_only_by_its_owner(gateway: Gateway, redis_url) -> None:
    for stream in (False, True):
        r = httpx.post(run_url(gateway), headers=auth(gateway.account.token),
                       json={"prompt": "Hello", "max_tokens": 5, "temperature": 0, "stream": stream})
        assert r.status_code == 200
    tenant = gateway.account.tenant_id
    assert len(wait_metered(redis_url, tenant, 2)) == 2
    usage = httpx.get(f"{gateway.url}/client/v4/accounts/{tenant}/ai/usage", headers=auth(gateway.account.token))
    assert usage.status_code == 200, usage.text
    (day,) = usage.json()["result"]["days"].values()
    row = day[MODEL]
    assert row["requests"] == 2 and row["completion_tokens"] == 10 and row["prompt_tokens"] > 0
    time.sleep(0.1)
    assert len(metered(redis_url, tenant)) == 2  # and not more

    other = make_account(redis_url, "globex")
    denied = httpx.get(f"{gateway.url}/client/v4/accounts/{tenant}/ai/usage", headers=auth(other.token))
    assert denied.status_code == 403 and denied.json()["errors"][0]["code"] == 10001
    assert "days" not in denied.text


def _series(text: str, name: str) -> dict[str, float]:
    """Prometheus text: the samples of `name`, by their label text."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1:].rsplit("} ", 1)
            out[labels] = float(value)
    return out


def test_a_known_token_is_answered_without_redis_and_the_metrics_say_so(gateway: Gateway, redis_url: str) -> None:
    """The first two requests of a token look it up (the second tracked), later ones are held; a key
    revoked by another client stops the very next request."""
    def lookups() -> dict[str, float]:
        return _series(httpx.get(f"{gateway.url}/metrics").text, "edgeserve_gateway_auth_lookups_total")

    account = make_account(redis_url, "held")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    before = lookups()
    for _ in range(5):
        resp = httpx.post(f"{gateway.url}/v1/chat/completions", headers=auth(account.token), json=body, timeout=30)
        assert resp.status_code == 200, resp.text
    after = lookups()
    assert after['result="redis"'] - before['result="redis"'] == 2
    assert after['result="held"'] - before['result="held"'] == 3
    revoke_key(redis_url, account.key_id)
    resp = httpx.post(f"{gateway.url}/v1/chat/completions", headers=auth(account.token), json=body, timeout=30)
    assert resp.status_code == 401, resp.text


def test_metrics_count_prompt_pieces_from_the_tokenizers_cache(gateway: Gateway) -> None:
    """The same chat twice: its pieces are encoded once (misses), then come from the tenant's cache (hits)."""
    def pieces() -> dict[str, float]:
        return _series(httpx.get(f"{gateway.url}/metrics").text, "edgeserve_gateway_prompt_pieces_total")

    before = pieces()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "pieces, once then cached"}], "max_tokens": 2}
    for _ in range(2):
        resp = httpx.post(f"{gateway.url}/v1/chat/completions", headers=auth(gateway.account.token), json=body,
                          timeout=30)
        assert resp.status_code == 200, resp.text
    after = pieces()
    hit, miss = f'model="{MODEL}",result="hit"', f'model="{MODEL}",result="miss"'
    assert after[miss] - before.get(miss, 0) >= 1  # the new message's piece, encoded on the first request
    assert after[hit] - before.get(hit, 0) >= after[miss] - before.get(miss, 0)  # every one of them hit the second
