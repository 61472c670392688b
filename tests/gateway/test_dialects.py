"""Each API in its own dialect (issue 19): OpenAI's statuses, error objects and headers on /v1/,
the Workers envelope and codes on /client/v4/, through the official `openai` client where it
decides which exception a status becomes. Real gateway, real worker (tiny model), real Redis."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.backend.servers import serve_in_thread
from tests.gateway.conftest import ALIAS, MODEL, Gateway, Worker, gateway_config, make_account, wait_metered
from tests.gateway.test_api import auth, run_url

MESSAGES = [{"role": "user", "content": "hi"}]


def client_for(gw: Gateway, token: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key=token or gw.account.token, max_retries=0)


def openai_error_of(resp: httpx.Response) -> dict:
    body = resp.json()
    assert set(body) == {"error"}, body
    return body["error"]


# --- 404 and 405 -----------------------------------------------------------------------------

def test_unknown_v1_route_is_an_openai_404(gateway: Gateway) -> None:
    resp = httpx.post(f"{gateway.url}/v1/completion", headers=auth(gateway.account.token), json={})
    assert resp.status_code == 404
    err = openai_error_of(resp)
    assert err["type"] == "invalid_request_error" and err["code"] == "unknown_url"
    assert "/v1/completion" in err["message"]
    with pytest.raises(openai.NotFoundError):
        client_for(gateway).post("/embeddings", cast_to=object, body={"input": "x"})
    # the Workers API keeps its envelope for its own unknown paths
    resp = httpx.get(f"{gateway.url}/client/v4/accounts/x/ai/nothing-here")
    assert resp.status_code == 404 and resp.json()["success"] is False


@pytest.mark.parametrize("method,path,allow", [("GET", "/v1/chat/completions", "POST"),
                                              ("DELETE", "/v1/models", "GET, HEAD")])
def test_wrong_method_is_an_openai_405_with_allow(gateway: Gateway, method: str, path: str, allow: str) -> None:
    resp = httpx.request(method, f"{gateway.url}{path}", headers=auth(gateway.account.token))
    assert resp.status_code == 405 and resp.headers["allow"] == allow
    err = openai_error_of(resp)
    assert err["code"] == "method_not_allowed"
    assert "no route" not in err["message"] and method in err["message"] and allow.split(",")[0] in err["message"]


def test_wrong_method_on_the_workers_api_is_a_workers_405(gateway: Gateway) -> None:
    resp = httpx.get(run_url(gateway), headers=auth(gateway.account.token))
    assert resp.status_code == 405 and resp.headers["allow"] == "POST"
    env = resp.json()
    assert env["success"] is False and env["errors"][0]["code"] == 3000 and "POST" in env["errors"][0]["message"]


# --- statuses the official client maps to the right exception -------------------------------

def test_unknown_model_is_not_found_on_openai_and_5007_400_on_workers(gateway: Gateway) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client_for(gateway).chat.completions.create(model="nope", messages=MESSAGES)
    assert info.value.status_code == 404 and info.value.code == "model_not_found"
    assert info.value.body["edgeserve_code"] == 5007
    resp = httpx.post(run_url(gateway, "@cf/meta/nope"), headers=auth(gateway.account.token), json={"prompt": "hi"})
    assert resp.status_code == 400 and resp.json()["errors"][0]["code"] == 5007


def test_prompt_plus_max_tokens_over_the_context_is_a_bad_request(gateway: Gateway) -> None:
    with pytest.raises(openai.BadRequestError) as info:  # the tiny model's context is 512 tokens
        client_for(gateway).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=600)
    assert info.value.status_code == 400 and info.value.code == "context_length_exceeded"
    assert "512" in info.value.message
    long = [{"role": "user", "content": "word " * 600}]  # the prompt alone
    with pytest.raises(openai.BadRequestError) as info:
        client_for(gateway).chat.completions.create(model=MODEL, messages=long, max_tokens=1)
    assert info.value.code == "context_length_exceeded"
    # the Workers API keeps 3006 / 413
    resp = httpx.post(run_url(gateway), headers=auth(gateway.account.token), json={"prompt": "hi", "max_tokens": 600})
    assert resp.status_code == 413 and resp.json()["errors"][0]["code"] == 3006


def test_missing_fields_are_named_in_param(gateway: Gateway) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client_for(gateway).chat.completions.create(model=MODEL, messages=[{"role": "user"}])  # no content
    assert info.value.param == "messages[0].content"
    for body, param in (({"messages": MESSAGES}, "model"), ({"model": MODEL}, "messages")):
        resp = httpx.post(f"{gateway.url}/v1/chat/completions", headers=auth(gateway.account.token), json=body)
        assert resp.status_code == 400 and openai_error_of(resp)["param"] == param


@pytest.fixture
def small_body_gateway(worker: Worker, tiny_chat_dir: Path, redis_url: str) -> Iterator[Gateway]:
    from gateway.app import create_gateway_app

    app = create_gateway_app(gateway_config(tiny_chat_dir, [worker.url], redis_url, max_request_bytes=2048))
    with serve_in_thread(app) as url:
        yield Gateway(url, make_account(redis_url), worker)


def test_an_oversized_body_is_413_and_not_a_context_error(small_body_gateway: Gateway) -> None:
    gw = small_body_gateway
    big = [{"role": "user", "content": "x" * 4000}]
    with pytest.raises(openai.APIStatusError) as info:
        client_for(gw).chat.completions.create(model=MODEL, messages=big, max_tokens=1)
    assert info.value.status_code == 413
    assert info.value.code == "request_too_large" and info.value.code != "context_length_exceeded"
    resp = httpx.post(run_url(gw), headers=auth(gw.account.token), json={"prompt": "x" * 4000})
    assert resp.status_code == 413 and resp.json()["errors"][0]["code"] == 3006


# --- GET /v1/models/{id} ---------------------------------------------------------------------

def test_retrieve_a_model_by_name_or_alias(gateway: Gateway) -> None:
    client = client_for(gateway)
    for name in (MODEL, ALIAS):  # the alias has slashes
        model = client.models.retrieve(name)
        assert model.id == name and model.object == "model" and model.model_extra["root"] == MODEL
        assert model.model_extra["max_model_len"] == 512
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("nope")
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.AuthenticationError):
        client_for(gateway, "es_nope").models.retrieve(MODEL)


# --- rate-limit headers and the quota cap ----------------------------------------------------

def test_rate_limit_headers_where_the_tenant_has_quotas(gateway: Gateway, redis_url: str) -> None:
    plain = client_for(gateway).chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES,
                                                                          max_tokens=2)
    assert not any(h.startswith("x-ratelimit-") for h in plain.headers)  # no quotas, no figures

    limited = make_account(redis_url, "limited", requests_per_minute=3, tokens_per_day=100_000)
    client = client_for(gateway, limited.token)
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    usage = raw.parse().usage
    assert raw.headers["x-ratelimit-limit-requests"] == "3"
    assert raw.headers["x-ratelimit-remaining-requests"] == "2"
    assert raw.headers["x-ratelimit-limit-tokens"] == "100000"
    assert raw.headers["x-ratelimit-remaining-tokens"] == str(100_000 - usage.prompt_tokens - 4)  # reserved
    wait_metered(redis_url, limited.tenant_id, 1)  # settled: the unused part of max_tokens came back
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    assert raw.headers["x-ratelimit-remaining-requests"] == "1"
    assert raw.headers["x-ratelimit-remaining-tokens"] == str(
        100_000 - usage.total_tokens - usage.prompt_tokens - 4)
    resp = httpx.post(run_url(gateway, account=limited.tenant_id), headers=auth(limited.token),
                      json={"prompt": "hi", "max_tokens": 2})  # the Workers API tells the same figures
    assert resp.status_code == 200 and resp.headers["x-ratelimit-remaining-requests"] == "0"
    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    headers = info.value.response.headers
    assert headers["x-ratelimit-limit-requests"] == "3" and headers["x-ratelimit-remaining-requests"] == "0"
    assert int(headers["retry-after"]) >= 1


def _prompt_tokens(gw: Gateway) -> int:
    done = client_for(gw).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    return done.usage.prompt_tokens


def test_a_quota_capped_max_tokens_is_told_in_each_dialect(gateway: Gateway, redis_url: str) -> None:
    prompt = _prompt_tokens(gateway)  # the same for "hi" on both APIs (one user message)
    workers = make_account(redis_url, "capped-w", tokens_per_day=prompt + 5)
    resp = httpx.post(run_url(gateway, account=workers.tenant_id), headers=auth(workers.token),
                      json={"prompt": "hi", "max_tokens": 50, "temperature": 0})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["result"]["usage"]["completion_tokens"] <= 5
    assert resp.headers["x-edgeserve-quota-capped-max-tokens"] == "5"
    (notice,) = body["messages"]
    assert notice["code"] == 3036 and "from 50 to 5" in notice["message"]

    chat = make_account(redis_url, "capped-o", tokens_per_day=prompt + 5)
    raw = client_for(gateway, chat.token).chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=50, temperature=0)
    done = raw.parse()
    assert raw.headers["x-edgeserve-quota-capped-max-tokens"] == "5"
    assert done.usage.completion_tokens <= 5
    assert done.choices[0].finish_reason == ("length" if done.usage.completion_tokens == 5 else "stop")

    uncapped = httpx.post(run_url(gateway), headers=auth(gateway.account.token), json={"prompt": "hi", "max_tokens": 3})
    assert "x-edgeserve-quota-capped-max-tokens" not in uncapped.headers and uncapped.json()["messages"] == []


def test_a_streamed_quota_cap_carries_the_header(gateway: Gateway, redis_url: str) -> None:
    prompt = _prompt_tokens(gateway)
    account = make_account(redis_url, "capped-s", tokens_per_day=prompt + 4)
    resp = httpx.post(run_url(gateway, account=account.tenant_id), headers=auth(account.token),
                      json={"prompt": "hi", "max_tokens": 50, "stream": True})
    assert resp.status_code == 200 and resp.headers["x-edgeserve-quota-capped-max-tokens"] == "4"


# --- Content-Type ----------------------------------------------------------------------------

@pytest.mark.parametrize("content_type", ["text/xml", "text/plain", "multipart/form-data; boundary=x"])
def test_a_non_json_content_type_is_415_in_each_dialect(gateway: Gateway, content_type: str) -> None:
    headers = {**auth(gateway.account.token), "content-type": content_type}
    body = json.dumps({"model": MODEL, "messages": MESSAGES, "prompt": "hi", "max_tokens": 1}).encode()
    resp = httpx.post(f"{gateway.url}/v1/chat/completions", headers=headers, content=body)
    assert resp.status_code == 415
    err = openai_error_of(resp)
    assert err["code"] == "unsupported_media_type" and "application/json" in err["message"]
    resp = httpx.post(run_url(gateway), headers=headers, content=body)
    assert resp.status_code == 415 and resp.json()["errors"][0]["code"] == 3000


@pytest.mark.parametrize("content_type", [None, "application/json", "application/json; charset=utf-8",
                                          "application/x-www-form-urlencoded"])  # the last: curl -d's default
def test_json_bodies_are_read_as_sent_by_sdks_scripts_and_curl(gateway: Gateway, content_type: str | None) -> None:
    headers = auth(gateway.account.token) | ({"content-type": content_type} if content_type else {})
    body = json.dumps({"model": MODEL, "messages": MESSAGES, "max_tokens": 1}).encode()
    resp = httpx.post(f"{gateway.url}/v1/chat/completions", headers=headers, content=body)
    assert resp.status_code == 200, resp.text
    resp = httpx.post(run_url(gateway), headers=headers, content=b'{"prompt": "hi", "max_tokens": 1}')
    assert resp.status_code == 200, resp.text
