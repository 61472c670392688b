"""Tenants and API keys for a benchmark's run, made straight in its own Redis (`gateway.tenants`),
as `edgeserve tenant create` and `edgeserve key create` would."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

__all__ = ["NewTenant", "create_tenants"]


class NewTenant(NamedTuple):
    id: str
    token: str  # its API key's bearer token


async def create_tenants(redis_url: str, tenants: Sequence[tuple[str, Mapping[str, int | None]]]
                         ) -> list[NewTenant]:
    """One tenant per (name, quota limits: `TenantStore.create_tenant`'s keywords) with one API key each,
    in order."""
    import redis.asyncio as aioredis

    from gateway.tenants import TenantStore

    client = aioredis.Redis.from_url(redis_url)
    try:
        store, out = TenantStore(client), []
        for name, limits in tenants:
            tenant = await store.create_tenant(name, **limits)
            out.append(NewTenant(tenant.id, (await store.create_key(tenant.id)).token))
        return out
    finally:
        await client.aclose()
