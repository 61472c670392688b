"""Streamed responses in front of a worker that sends one event per token with no pause (the
per-token stand-in of `edgeserve bench gateway`): one client event per token on both APIs,
the stream ends without waiting for the usage to reach Redis, and that usage is metered
exactly once, settling the tenant's token reservation."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from pathlib import Path

import httpx
import pytest
import redis

from gateway import redis_keys as rk
from gateway.app import create_gateway_app
from ops.bench.gateway.standin_per_token import per_token_standin_app
from ops.standin_worker import HELLO_WORLD, token_text
from tests.backend.servers import serve_in_thread
from tests.gateway.conftest import MODEL, gateway_config, make_account, metered, wait_metered
from tests.gateway.test_api import auth

N = 12
METER_DELAY_S = 2.0


@pytest.fixture(scope="module")
def standin() -> str:
    with serve_in_thread(per_token_standin_app(N)) as url:
        yield url


def _events(text: str) -> list[str]:
    return [e[len("data: "):] for e in text.split("\n\n") if e.startswith("data: ")]


@pytest.mark.parametrize("api", ["openai", "workers"])
def test_one_event_per_token_and_the_stream_ends_before_metering(standin: str, tiny_chat_dir: Path,
                                                                 redis_url: str, api: str) -> None:
    app = create_gateway_app(gateway_config(tiny_chat_dir, [standin], redis_url))
    meter = app.state.gateway.meter
    record = meter.record

    async def slow_record(*args, **kwargs):  # Redis taking its time: the client must not wait for it
        await asyncio.sleep(METER_DELAY_S)
        return await record(*args, **kwargs)

    meter.record = slow_record
    account = make_account(redis_url, requests_per_minute=100, tokens_per_day=100_000)
    if api == "openai":
        path, body = "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                              "stream": True, "stream_options": {"include_usage": True}}
    else:
        path, body = f"/client/v4/accounts/{account.tenant_id}/ai/run/{MODEL}", {"prompt": "hi", "stream": True}
    _, text = token_text(N)
    with serve_in_thread(app) as url:
        t0 = time.monotonic()
        resp = httpx.post(f"{url}{path}", headers=auth(account.token), json=body, timeout=30)
        elapsed = time.monotonic() - t0
        assert resp.status_code == 200, resp.text
        events = _events(resp.text)
        (usage_event,) = wait_metered(redis_url, account.tenant_id, 1, timeout=METER_DELAY_S + 10)
        time.sleep(0.2)
        assert len(metered(redis_url, account.tenant_id)) == 1  # exactly once
    assert elapsed < METER_DELAY_S * 0.75, elapsed  # the last byte did not wait for the usage record
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    if api == "openai":
        pieces = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
        assert pieces[:N] == [piece for _, piece in itertools.islice(itertools.cycle(HELLO_WORLD), N)]
        assert pieces[N:] == [None] and chunks[N]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["usage"]["completion_tokens"] == N
    else:
        pieces = [c["response"] for c in chunks]
        assert "".join(pieces) == text and len(pieces) == N + 1  # one per token, then the final event
        assert chunks[-1]["usage"]["completion_tokens"] == N
    assert int(usage_event["completion_tokens"]) == N and usage_event["finish_reason"] == "length"
    client = redis.Redis.from_url(redis_url)
    used = sum(int(client.get(k) or 0) for k in client.keys(rk.tokens_day(account.tenant_id, "*")))
    client.close()
    assert used == int(usage_event["prompt_tokens"]) + N  # the reservation settled to what was used
