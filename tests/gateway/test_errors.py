"""Typed refusals through the gateway: each maps once to a Workers envelope / OpenAI error and loses nothing."""

from __future__ import annotations

import httpx
import openai
import pytest

from gateway.envelopes import openai_error, workers_error
from backend.errors import QuotaExceeded
from tests.gateway.conftest import ALIAS, MODEL, Gateway, wait_pages_free
from tests.gateway.test_api import auth, run_url


def post_run(gw: Gateway, body: bytes | dict, token: str | None = None, account: str | None = None,
             model: str = ALIAS) -> httpx.Response:
    headers = auth(token or gw.account.token)
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    return httpx.post(run_url(gw, model, account), headers=headers, **kw)


@pytest.mark.parametrize("body,status,code,field", [
    (b"{not json", 400, 3000, None),
    (b"", 400, 3000, None),
    (b'{"prompt": 5}', 400, 3000, "prompt"),
    (b'{"prompt": "hi", "max_tokens": 0}', 400, 3000, "max_tokens"),
    (b'{"prompt": "hi", "max_tokens": "ten"}', 400, 3000, "max_tokens"),
    (b'{"prompt": "hi", "temperature": 9}', 400, 3000, "temperature"),
    (b'{"messages": []}', 400, 3000, "messages"),
    (b'{"messages": [{"role": "wizard", "content": "x"}]}', 400, 3000, "messages[0].role"),
    (b'{"prompt": "hi", "messages": [{"role": "user", "content": "x"}]}', 400, 3000, "prompt"),
    (b'{}', 400, 3000, "prompt"),
    (b'{"prompt": "hi", "frequency_penalty": 2.5}', 400, 3000, "frequency_penalty"),
    (b'{"prompt": "hi", "repetition_penalty": 0}', 400, 3000, "repetition_penalty"),
    (b'{"prompt": "' + b"word " * 600 + b'"}', 413, 3006, None),
    (b'{"prompt": "hi", "max_tokens": 600}', 413, 3006, None),  # prompt + max_tokens over the context
])
def test_bad_workers_requests(gateway: Gateway, body: bytes, status: int, code: int, field: str | None) -> None:
    resp = post_run(gateway, body)
    assert resp.status_code == status, resp.text
    env = resp.json()
    assert env["success"] is False and env["result"] is None and env["errors"][0]["code"] == code
    if field is not None:
        assert field.split("[")[0] in env["errors"][0]["message"]
    wait_pages_free(gateway.worker.engine)


def test_unknown_model_is_5007_and_400_on_workers_and_404_on_openai(gateway: Gateway) -> None:
    resp = post_run(gateway, {"prompt": "hi"}, model="@cf/meta/nope")
    assert resp.status_code == 400 and resp.json()["errors"][0]["code"] == 5007
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=gateway.account.token, max_retries=0)
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert info.value.body["code"] == "model_not_found" and info.value.body["edgeserve_code"] == 5007


def test_authentication_and_tenant_isolation(gateway: Gateway, redis_url) -> None:
    from tests.gateway.conftest import make_account

    for headers in ({}, {"authorization": "Bearer es_wrong"}, {"authorization": "Basic abc"}):
        resp = httpx.post(run_url(gateway), headers=headers, json={"prompt": "hi"})
        assert resp.status_code == 401 and resp.json()["errors"][0]["code"] == 10000
        assert "es_wrong" not in resp.text
    other = make_account(redis_url, "globex")
    resp = post_run(gateway, {"prompt": "hi", "max_tokens": 2}, token=other.token)  # acme's path, globex's token
    assert resp.status_code == 403 and resp.json()["errors"][0]["code"] == 10001
    resp = post_run(gateway, {"prompt": "hi", "max_tokens": 2}, token=other.token, account=other.tenant_id)
    assert resp.status_code == 200
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="es_nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])


def test_revoked_key_stops_working(gateway: Gateway, redis_url) -> None:
    import asyncio

    import redis.asyncio as aioredis

    from gateway.tenants import TenantStore

    assert post_run(gateway, {"prompt": "hi", "max_tokens": 1}).status_code == 200

    async def revoke() -> bool:
        r = aioredis.Redis.from_url(redis_url)
        try:
            return await TenantStore(r).revoke_key(gateway.account.key_id)
        finally:
            await r.aclose()

    assert asyncio.run(revoke())
    assert post_run(gateway, {"prompt": "hi", "max_tokens": 1}).status_code == 401


def test_openai_validation_names_the_field(gateway: Gateway) -> None:
    url = f"{gateway.url}/v1/chat/completions"
    cases = [({"model": MODEL, "messages": []}, "messages"),
             ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}, "max_tokens"),
             ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
             ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
             ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": True,
               "top_logprobs": 21}, "top_logprobs"),
             ({"messages": [{"role": "user", "content": "x"}]}, "model")]
    for body, field in cases:
        resp = httpx.post(url, headers=auth(gateway.account.token), json=body)
        assert resp.status_code == 400, (body, resp.text)
        err = resp.json()["error"]
        assert err["type"] == "invalid_request_error" and field in err["message"]


def test_error_objects_carry_retry_after() -> None:
    exc = QuotaExceeded("spent", quota="tokens_per_day", limit=10, retry_after_s=12.2)
    assert workers_error(exc)["errors"] == [{"code": 3036, "message": "spent"}]
    assert openai_error(exc)["error"]["code"] == "insufficient_quota"
    from gateway.envelopes import error_headers

    assert error_headers(exc) == {"Retry-After": "13"}
