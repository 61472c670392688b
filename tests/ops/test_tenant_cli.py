"""`edgeserve tenant …` / `edgeserve key …` in-process against a real Redis."""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest
import redis.asyncio

from backend.errors import AuthenticationError, InvalidRequest
from gateway.metering import Meter, UsageRecord
from gateway.redis_keys import utc_day
from gateway.tenants import Tenant, TenantStore
from ops import tenant as tenant_cli


def _cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    tenant_cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    return args.func(args)


def _store_call(redis_url: str, method: str, *args):
    async def main():
        async with redis.asyncio.Redis.from_url(redis_url) as client:
            return await getattr(TenantStore(client), method)(*args)
    return asyncio.run(main())


def test_tenant_create_and_list(redis_url: str, capsys) -> None:
    assert _cli("tenant", "create", "Acme Corp", "--id", "acme", "--rpm", "60", "--tokens-per-day", "5000",
                "--redis-url", redis_url) == 0
    assert capsys.readouterr().out == "acme\n"
    assert _cli("tenant", "create", "Beta", "--json", "--redis-url", redis_url) == 0
    beta = json.loads(capsys.readouterr().out)
    assert beta["name"] == "Beta" and len(beta["id"]) == 32 and beta["requests_per_minute"] is None
    assert _cli("tenant", "list", "--redis-url", redis_url) == 0
    listed = json.loads(capsys.readouterr().out)
    assert sorted(t["id"] for t in listed) == sorted(["acme", beta["id"]])
    assert {"id": "acme", "name": "Acme Corp", "requests_per_minute": 60, "tokens_per_day": 5000} in listed
    with pytest.raises(InvalidRequest):
        _cli("tenant", "create", "again", "--id", "acme", "--redis-url", redis_url)


def test_set_quotas_keeps_what_is_not_given(redis_url: str, capsys) -> None:
    _cli("tenant", "create", "Acme", "--id", "acme", "--rpm", "60", "--tokens-per-day", "5000",
         "--redis-url", redis_url)
    capsys.readouterr()
    assert _cli("tenant", "set-quotas", "acme", "--rpm", "unlimited", "--redis-url", redis_url) == 0
    assert json.loads(capsys.readouterr().out)["requests_per_minute"] is None
    assert _store_call(redis_url, "get_tenant", "acme") == Tenant("acme", "Acme", None, 5000)
    _cli("tenant", "set-quotas", "acme", "--tokens-per-day", "7", "--redis-url", redis_url)
    assert _store_call(redis_url, "get_tenant", "acme") == Tenant("acme", "Acme", None, 7)


def test_key_create_shows_the_token_once_and_revoke_disables_it(redis_url: str, capsys) -> None:
    _cli("tenant", "create", "Acme", "--id", "acme", "--redis-url", redis_url)
    capsys.readouterr()
    assert _cli("key", "create", "acme", "--redis-url", redis_url) == 0
    out = capsys.readouterr()
    lines = dict(line.split(":", 1) for line in out.out.splitlines())
    key_id, token = lines["key_id"].strip(), lines["token"].strip()
    assert token.startswith("es_") and "shown only this once" in out.err
    assert _store_call(redis_url, "authenticate", f"Bearer {token}").id == "acme"

    assert _cli("key", "create", "acme", "--json", "--redis-url", redis_url) == 0
    second = json.loads(capsys.readouterr().out)
    assert second["tenant_id"] == "acme" and second["token"].startswith("es_")

    assert _cli("key", "revoke", key_id, "--redis-url", redis_url) == 0
    assert capsys.readouterr().out == f"revoked {key_id}\n"
    with pytest.raises(AuthenticationError):
        _store_call(redis_url, "authenticate", f"Bearer {token}")
    assert _store_call(redis_url, "authenticate", f"Bearer {second['token']}").id == "acme"
    assert _cli("key", "revoke", key_id, "--redis-url", redis_url) == 1
    with pytest.raises(InvalidRequest):
        _cli("key", "create", "nobody", "--redis-url", redis_url)


def test_tenant_usage_prints_json(redis_url: str, capsys) -> None:
    async def record():
        async with redis.asyncio.Redis.from_url(redis_url) as client:
            await Meter(client).record(UsageRecord("r1", "acme", "m1", 10, 0, 5, "stop"))
    asyncio.run(record())
    today = utc_day()
    assert _cli("tenant", "usage", "acme", "--redis-url", redis_url) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["to"] == today and out["usage"] == {today: {"m1": {
        "requests": 1, "prompt_tokens": 10, "cached_prompt_tokens": 0, "completion_tokens": 5}}}
    assert _cli("tenant", "usage", "acme", "--from", "2020-01-01", "--to", "2020-01-02", "--redis-url", redis_url) == 0
    assert json.loads(capsys.readouterr().out)["usage"] == {}
    with pytest.raises(InvalidRequest):
        _cli("tenant", "usage", "acme", "--from", "2020-01-01", "--to", "2021-01-01", "--redis-url", redis_url)


def test_redis_url_comes_from_the_flag_the_environment_the_running_cluster_or_the_default(
        redis_url: str, tmp_path, monkeypatch, capsys) -> None:
    from ops.cli import main
    from ops.cluster_record import new_record, write_record

    monkeypatch.setenv("EDGESERVE_HOME", str(tmp_path))
    monkeypatch.delenv("REDIS_URL", raising=False)
    assert tenant_cli.default_redis_url() == "redis://127.0.0.1:6379/0"
    # what `edgeserve up` leaves while it runs (this process stands in for it): the admin commands find its Redis
    write_record(new_record(gateway_url="http://127.0.0.1:1", redis_url=redis_url, worker_urls=[], worker_pids=[],
                            model="m", tenant_id="demo", token="es_x"))
    assert main(["tenant", "create", "Acme", "--id", "acme"]) == 0
    assert capsys.readouterr().out == "acme\n"
    assert _store_call(redis_url, "get_tenant", "acme") == Tenant("acme", "Acme", None, None)
    assert main(["key", "create", "acme", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tenant_id"] == "acme"

    monkeypatch.setenv("REDIS_URL", "redis://example:1234/3")
    assert tenant_cli.default_redis_url() == "redis://example:1234/3"
    parser = argparse.ArgumentParser()
    tenant_cli.register(parser.add_subparsers(dest="command", required=True))
    assert parser.parse_args(["key", "revoke", "abc", "--redis-url", "redis://flag:1/0"]).redis_url == "redis://flag:1/0"
