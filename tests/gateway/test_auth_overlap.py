"""The token lookup overlaps the request's own work only for a token that authenticated lately,
and its answer still decides before any quota, worker or usage: a key revoked between two
requests fails the second at once, an authentication error wins over a bad body, and a token
that never authenticated gets nothing done for it (its prompt is not even tokenised)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import redis

from gateway import redis_keys as rk
from gateway.app import create_gateway_app
from tests.backend.servers import serve_in_thread
from tests.gateway.conftest import (MODEL, Account, Worker, gateway_config, make_account, metered, revoke_key,
                                    wait_metered)
from tests.gateway.test_api import auth


@pytest.fixture
def served(worker: Worker, tiny_chat_dir: Path, redis_url: str):
    app = create_gateway_app(gateway_config(tiny_chat_dir, [worker.url], redis_url, tenant_cache_s=60.0))
    model = app.state.gateway.catalog.resolve(MODEL)
    calls: list[tuple] = []
    encode = model.chat_prompt_ids

    def counted(*args, **kwargs):  # records the prompts tokenised (their arguments); the real encoding runs
        calls.append(args)
        return encode(*args, **kwargs)

    model.chat_prompt_ids = counted
    with serve_in_thread(app) as url:
        yield url, calls


def _chat(url: str, token: str, content: bytes | None = None) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    if content is None:
        return httpx.post(f"{url}/v1/chat/completions", headers=auth(token), json=body, timeout=30)
    return httpx.post(f"{url}/v1/chat/completions", headers=auth(token), content=content, timeout=30)


def test_a_key_revoked_after_a_request_fails_the_next_and_costs_nothing(served, redis_url: str) -> None:
    url, calls = served
    account: Account = make_account(redis_url, requests_per_minute=100, tokens_per_day=10_000)
    first = _chat(url, account.token)
    assert first.status_code == 200, first.text
    (event,) = wait_metered(redis_url, account.tenant_id, 1)
    revoke_key(redis_url, account.key_id)
    second = _chat(url, account.token)  # the token authenticated a moment ago: the overlapping path
    assert second.status_code == 401, second.text
    third = _chat(url, account.token, content=b'{"model": ')  # revoked and malformed: 401 wins
    assert third.status_code == 401, third.text
    assert len(metered(redis_url, account.tenant_id)) == 1
    client = redis.Redis.from_url(redis_url)
    used = sum(int(client.get(k) or 0) for k in client.keys(rk.tokens_day(account.tenant_id, "*")))
    window = client.zcard(rk.rpm_window(account.tenant_id))
    client.close()
    assert used == int(event["prompt_tokens"]) + int(event["completion_tokens"])  # nothing reserved since
    assert window == 1  # the refused requests took no place in the minute's window


def test_a_token_that_never_authenticated_gets_nothing_done(served, redis_url: str) -> None:
    url, calls = served
    account = make_account(redis_url)
    assert _chat(url, "es_" + "x" * 43).status_code == 401
    assert _chat(url, "es_" + "y" * 43, content=b"not json").status_code == 401  # 401 before the body's 400
    assert calls == []  # no prompt tokenised for either
    assert _chat(url, account.token, content=b"not json").status_code == 400
    assert _chat(url, account.token).status_code == 200
    assert len(calls) == 1
    assert calls[0][2] == account.tenant_id  # the prompt's pieces cached under the caller's tenant
    assert _chat(url, account.token).status_code == 200  # authenticated a moment ago: the hint's tenant
    assert len(calls) == 2 and calls[1][2] == account.tenant_id


def test_the_account_check_comes_before_the_body(served, redis_url: str) -> None:
    url, _ = served
    account, other = make_account(redis_url), make_account(redis_url, name="other")
    run = f"{url}/client/v4/accounts/{other.tenant_id}/ai/run/{MODEL}"
    for _ in range(2):  # cold, then with the token just authenticated
        resp = httpx.post(run, headers=auth(account.token), content=b"not json", timeout=30)
        assert resp.status_code == 403, resp.text
        assert _chat(url, account.token).status_code == 200
