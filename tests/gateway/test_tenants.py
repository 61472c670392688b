"""Tenants and API keys against a real Redis: authentication, revocation, hashing at rest."""

from __future__ import annotations

import asyncio
import hashlib
import re

import pytest
import redis
import redis.asyncio

from backend.errors import AuthenticationError, InvalidRequest, StoreUnavailable
from gateway import redis_keys as rk
from gateway.redis_keys import STORE_RETRY_AFTER_S
from gateway.tenants import Tenant, TenantStore
from ops.redis_server import free_port


def _with_store(redis_url: str, body):
    async def main():
        async with redis.asyncio.Redis.from_url(redis_url) as client:
            return await body(TenantStore(client))
    return asyncio.run(main())


def test_created_key_authenticates_its_tenant(redis_url: str) -> None:
    async def body(store: TenantStore):
        tenant = await store.create_tenant("acme", requests_per_minute=60, tokens_per_day=10_000)
        key = await store.create_key(tenant.id)
        assert re.fullmatch(r"[0-9a-f]{32}", tenant.id)
        assert re.fullmatch(r"[0-9a-f]{12}", key.key_id) and key.tenant_id == tenant.id
        assert key.token.startswith("es_") and len(key.token) > 40
        assert await store.authenticate(f"Bearer {key.token}") == tenant
        assert await store.authenticate(f"  bearer   {key.token} ") == tenant  # scheme is case-insensitive
        assert await store.get_tenant(tenant.id) == Tenant(tenant.id, "acme", 60, 10_000)
    _with_store(redis_url, body)


def test_bad_credentials_are_refused_without_echoing_the_token(redis_url: str) -> None:
    async def body(store: TenantStore):
        tenant = await store.create_tenant("acme")
        token = (await store.create_key(tenant.id)).token
        headers = [None, "", "   ", "Bearer", "Bearer ", "Basic " + token, f"Token {token}", token,
                   f"Bearer {token}x", f"Bearer {token[:-1]}", f"Bearer {token} extra", "Bearer es_nope"]
        for header in headers:
            with pytest.raises(AuthenticationError) as info:
                await store.authenticate(header)
            assert info.value.code == 10000 and info.value.http_status == 401
            assert token[3:] not in str(info.value.to_dict())
    _with_store(redis_url, body)


def test_revoked_key_stops_authenticating_and_others_keep_working(redis_url: str) -> None:
    async def body(store: TenantStore):
        tenant = await store.create_tenant("acme")
        revoked, kept = await store.create_key(tenant.id), await store.create_key(tenant.id)
        assert await store.authenticate(f"Bearer {revoked.token}") == tenant
        assert await store.revoke_key(revoked.key_id) is True
        with pytest.raises(AuthenticationError):
            await store.authenticate(f"Bearer {revoked.token}")
        assert await store.revoke_key(revoked.key_id) is False
        assert await store.revoke_key("000000000000") is False
        assert await store.authenticate(f"Bearer {kept.token}") == tenant
        members = await store.redis.smembers(rk.tenant_keys(tenant.id))
        assert members == {kept.key_id.encode()}
    _with_store(redis_url, body)


def _every_stored_string(client: redis.Redis) -> list[bytes]:
    """Every key name, field and value in the database, whatever the key's type."""
    out: list[bytes] = []
    for key in client.scan_iter():
        out.append(key)
        kind = client.type(key).decode()
        if kind == "string":
            out.append(client.get(key))
        elif kind == "hash":
            out.extend(b for kv in client.hgetall(key).items() for b in kv)
        elif kind == "set":
            out.extend(client.smembers(key))
        elif kind == "zset":
            out.extend(m for m, _ in client.zrange(key, 0, -1, withscores=True))
        else:
            raise AssertionError(f"unexpected key type {kind} at {key!r}")
    return out


def test_redis_holds_only_the_token_hash(redis_url: str) -> None:
    async def body(store: TenantStore):
        tenant = await store.create_tenant("acme")
        return await store.create_key(tenant.id)
    key = _with_store(redis_url, body)
    client = redis.Redis.from_url(redis_url)
    stored = _every_stored_string(client)
    digest = hashlib.sha256(key.token.encode()).hexdigest().encode()
    assert any(digest in s for s in stored)  # the lookup exists ...
    assert not any(key.token[3:].encode() in s for s in stored)  # ... and the secret does not
    client.close()


def test_each_key_maps_to_its_own_tenant(redis_url: str) -> None:
    async def body(store: TenantStore):
        a = await store.create_tenant("a", tenant_id="tenant-a")
        b = await store.create_tenant("b", tenant_id="tenant-b", tokens_per_day=5)
        keys = {t.id: [await store.create_key(t.id) for _ in range(2)] for t in (a, b)}
        for tenant in (a, b):
            for key in keys[tenant.id]:
                assert await store.authenticate(f"Bearer {key.token}") == tenant
        assert await store.list_tenants() == [a, b]
    _with_store(redis_url, body)


def test_tenant_validation_and_quota_updates(redis_url: str) -> None:
    async def body(store: TenantStore):
        await store.create_tenant("acme", tenant_id="acme")
        for kwargs in ({"tenant_id": "acme"}, {"tenant_id": "a}b"}, {"tenant_id": ""},
                       {"requests_per_minute": 0}, {"tokens_per_day": -5}):
            with pytest.raises(InvalidRequest):
                await store.create_tenant("x", **kwargs)
        with pytest.raises(InvalidRequest):
            await store.create_key("no-such-tenant")
        with pytest.raises(InvalidRequest):
            await store.set_quotas("no-such-tenant", requests_per_minute=1, tokens_per_day=None)
        updated = await store.set_quotas("acme", requests_per_minute=7, tokens_per_day=100)
        assert updated == Tenant("acme", "acme", 7, 100)
        updated = await store.set_quotas("acme", requests_per_minute=None, tokens_per_day=100)
        assert updated == Tenant("acme", "acme", None, 100)
        assert await store.get_tenant("acme") == Tenant("acme", "acme", None, 100)
        assert await store.get_tenant("missing") is None
        assert [t.id for t in await store.list_tenants()] == ["acme"]
    _with_store(redis_url, body)


def test_redis_down_is_a_typed_503_without_its_address() -> None:
    port = free_port()

    async def main():
        async with redis.asyncio.Redis.from_url(f"redis://:hunter2@127.0.0.1:{port}/0") as client:
            with pytest.raises(StoreUnavailable) as info:
                await TenantStore(client).authenticate("Bearer es_whatever")
        err = info.value
        assert (err.code, err.http_status, err.details["retry_after_s"]) == (5021, 503, STORE_RETRY_AFTER_S)
        assert str(port) not in repr(err.to_dict()) and "127.0.0.1" not in repr(err.to_dict())
        assert "hunter2" not in repr(err.to_dict())
    asyncio.run(main())


def test_the_tenant_cache_saves_lookups_but_never_outlives_a_revoked_key(redis_url: str) -> None:
    import asyncio

    import redis.asyncio as aioredis

    from gateway.tenants import TenantStore

    async def go() -> None:
        r = aioredis.Redis.from_url(redis_url)
        store = TenantStore(r, tenant_cache_s=60.0)
        tenant = await store.create_tenant("cached", requests_per_minute=5)
        key = await store.create_key(tenant.id)
        assert (await store.authenticate(f"Bearer {key.token}")).requests_per_minute == 5
        await store.set_quotas(tenant.id, requests_per_minute=9, tokens_per_day=None)
        assert (await store.authenticate(f"Bearer {key.token}")).requests_per_minute == 5  # cached record
        assert (await TenantStore(r).authenticate(f"Bearer {key.token}")).requests_per_minute == 9  # uncached
        await store.revoke_key(key.key_id)
        with pytest.raises(AuthenticationError):
            await store.authenticate(f"Bearer {key.token}")  # revocation is immediate despite the cache
        await r.aclose()

    asyncio.run(go())


def test_cache_namespace_is_the_tenant_once_known_without_waiting() -> None:
    from gateway.tenants import PendingAuth, Tenant

    async def go() -> None:
        loop = asyncio.get_running_loop()
        tenant = Tenant(id="t-1", name="one")
        waiting = loop.create_future()
        assert PendingAuth(waiting, None).cache_namespace() is None  # lookup in flight, no hint
        assert PendingAuth(waiting, tenant).cache_namespace() == "t-1"  # the hint
        answered = loop.create_future()
        answered.set_result(tenant)
        assert PendingAuth(answered, None).cache_namespace() == "t-1"
        refused = loop.create_future()
        refused.set_exception(AuthenticationError("no"))
        assert PendingAuth(refused, None).cache_namespace() is None
        waiting.cancel()

    asyncio.run(go())
