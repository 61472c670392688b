"""Gateway fixtures: a real worker serving the tiny chat model (tests/conftest.py) on loopback,
real Redis, and a gateway in front."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
import redis.asyncio as aioredis

from backend.async_engine import AsyncEngine
from backend.engine import EngineConfig, LLMEngine
from backend.worker import create_worker_app
from gateway.app import create_gateway_app
from gateway.config import GatewayConfig, ModelRoute
from gateway.tenants import TenantStore
from tests.backend.servers import serve_in_thread

MODEL = "tiny-chat"
ALIAS = "@cf/edgeserve/tiny-chat"


def tiny_engine(model_dir: Path, **overrides) -> LLMEngine:
    cfg = dict(dtype="float32", kv_format="fp32", kv_cache_bytes=4 * 2**20, page_size=16, max_model_len=512,
               gemm_buckets=())
    cfg.update(overrides)
    return LLMEngine.from_pretrained(model_dir, EngineConfig(**cfg))


class Worker(NamedTuple):
    url: str
    engine: LLMEngine


@pytest.fixture(scope="module")
def worker(tiny_chat_dir: Path) -> Iterator[Worker]:
    engine = tiny_engine(tiny_chat_dir)
    with serve_in_thread(create_worker_app(AsyncEngine(engine), model_name=MODEL)) as url:
        yield Worker(url, engine)


def gateway_config(model_dir: Path, workers: list[str], redis_url: str, **kw) -> GatewayConfig:
    return GatewayConfig(models=[ModelRoute(MODEL, str(model_dir), workers, aliases=[ALIAS], max_model_len=512)],
                         redis_url=redis_url, **kw)


class Account(NamedTuple):
    tenant_id: str
    token: str
    key_id: str


def make_account(redis_url: str, name: str = "acme", **quotas) -> Account:
    async def go() -> Account:
        r = aioredis.Redis.from_url(redis_url)
        try:
            store = TenantStore(r)
            tenant = await store.create_tenant(name, **quotas)
            key = await store.create_key(tenant.id)
            return Account(tenant.id, key.token, key.key_id)
        finally:
            await r.aclose()

    return asyncio.run(go())


def revoke_key(redis_url: str, key_id: str) -> None:
    """Revoke the key through a client of its own, as `edgeserve key revoke` does."""
    async def go() -> None:
        r = aioredis.Redis.from_url(redis_url)
        try:
            assert await TenantStore(r).revoke_key(key_id)
        finally:
            await r.aclose()

    asyncio.run(go())


class Gateway(NamedTuple):
    url: str
    account: Account
    worker: Worker


@pytest.fixture
def gateway(worker: Worker, tiny_chat_dir: Path, redis_url: str) -> Iterator[Gateway]:
    app = create_gateway_app(gateway_config(tiny_chat_dir, [worker.url], redis_url, keepalive_s=5.0))
    with serve_in_thread(app) as url:
        yield Gateway(url, make_account(redis_url), worker)


def wait_pages_free(engine: LLMEngine, timeout: float = 10.0) -> None:
    """Block until the engine is idle with every page free (fails the test otherwise)."""
    deadline = time.monotonic() + timeout
    while engine.allocator.num_free != engine.allocator.num_pages or engine.has_work():
        assert time.monotonic() < deadline, engine.snapshot()
        time.sleep(0.02)


def metered(redis_url: str, tenant: str) -> list[dict[str, str]]:
    """The tenant's usage events (one per metered request), oldest first."""
    import redis

    from gateway import redis_keys

    r = redis.Redis.from_url(redis_url, decode_responses=True)
    return [fields for _, fields in r.xrange(redis_keys.usage_events(tenant))]


def wait_metered(redis_url: str, tenant: str, n: int, timeout: float = 10.0) -> list[dict[str, str]]:
    """Block until `n` usage events exist (metering finishes after the response)."""
    deadline = time.monotonic() + timeout
    while len(events := metered(redis_url, tenant)) < n:
        assert time.monotonic() < deadline, events
        time.sleep(0.02)
    return events
