"""`Generation.start` runs quota admission and routing side by side: the quota's answer still
decides, a refused request leaves no trace in the router, and a request the router cannot place
gives its reservation back. Real Redis, a real Router over a static worker list (never contacted:
every case here ends before a worker is called)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from backend.errors import NoCapacity, QuotaExceeded
from backend.sampling_params import SamplingParams
from gateway import redis_keys as rk
from gateway.config import ModelRoute
from gateway.generation import Generation
from gateway.metering import Meter
from gateway.metrics import GatewayMetrics
from gateway.quotas import Quotas
from gateway.regions import RegionMap
from gateway.registry_view import StaticView
from gateway.router import Router
from gateway.served_models import ServedModel
from gateway.tenants import Tenant
from gateway.worker_pool import WorkerPool

MODEL = "tiny-chat"
WORKER = "http://127.0.0.1:9"  # discard port: nothing here reaches it


@pytest.fixture(scope="module")
def model(tiny_chat_dir: Path) -> ServedModel:
    return ServedModel(ModelRoute(MODEL, str(tiny_chat_dir)))


def _run(redis_url: str, body) -> None:
    async def go() -> None:
        client = aioredis.Redis.from_url(redis_url)
        try:
            await body(client)
        finally:
            await client.aclose()

    asyncio.run(go())


def _generation(client: aioredis.Redis, model: ServedModel, tenant: Tenant, router: Router,
                prompt_ids: list[int], max_tokens: int = 8) -> Generation:
    return Generation(tenant=tenant, model=model, prompt_ids=prompt_ids, params=SamplingParams(max_tokens=max_tokens),
                      api="openai", region="local", router=router, pool=WorkerPool(), quotas=Quotas(client),
                      meter=Meter(client), metrics=GatewayMetrics())


def _router(workers: list[str]) -> Router:
    return Router(StaticView({MODEL: workers} if workers else {}, "local"), None, RegionMap(), policy="least-loaded")


async def _tokens_today(client: aioredis.Redis, tenant_id: str) -> int:
    keys = await client.keys(rk.tokens_day(tenant_id, "*"))
    return sum(int(v or 0) for v in await client.mget(keys)) if keys else 0


def test_a_quota_refusal_wins_over_no_capacity(redis_url: str, model: ServedModel) -> None:
    tenant = Tenant("acme", "acme", tokens_per_day=50)  # too few for the 60-token prompt

    async def body(client: aioredis.Redis) -> None:
        gen = _generation(client, model, tenant, _router([]), list(range(100, 160)))
        with pytest.raises(QuotaExceeded) as info:
            await gen.start()
        assert info.value.details["quota"] == "tokens_per_day"
        assert await _tokens_today(client, "acme") == 0  # a refusal consumes nothing

    _run(redis_url, body)


def test_a_request_nobody_can_serve_gives_its_reservation_back(redis_url: str, model: ServedModel) -> None:
    tenant = Tenant("acme", "acme", requests_per_minute=100, tokens_per_day=1000)

    async def body(client: aioredis.Redis) -> None:
        gen = _generation(client, model, tenant, _router([]), list(range(100, 120)), max_tokens=30)
        with pytest.raises(NoCapacity):
            await gen.start()
        assert await _tokens_today(client, "acme") == 0  # reserved 50, released 50
        assert await client.exists(rk.metered("acme", gen.request_id)) == 1  # settled: a replay changes nothing
        again = await Quotas(client).admit(tenant, "next", prompt_tokens=20, max_tokens=980)
        assert again.max_tokens == 980  # the whole day is still there

    _run(redis_url, body)


def test_a_refused_request_leaves_no_load_on_the_worker_it_was_routed_to(redis_url: str, model: ServedModel) -> None:
    tenant = Tenant("acme", "acme", requests_per_minute=1)
    router = _router([WORKER])

    async def body(client: aioredis.Redis) -> None:
        await Quotas(client).admit(tenant, "earlier", prompt_tokens=1, max_tokens=1)  # the minute's one request
        gen = _generation(client, model, tenant, router, list(range(100, 120)))
        with pytest.raises(QuotaExceeded) as info:
            await gen.start()
        assert info.value.details["quota"] == "requests_per_minute"
        assert gen.route is not None  # routing ran meanwhile ...
        probe = await router.route(MODEL, "other", [1, 2, 3], 4, "local", "probe")
        assert probe.reason.endswith("(load 0)")  # ... and took its request back off the worker
        router.done("probe")
        loaded = await router.route(MODEL, "other", [1, 2, 3], 4, "local", "held")
        assert (await router.route(MODEL, "other", [1], 1, "local", "probe2")).reason.endswith("(load 1)")
        assert loaded.candidates[0].worker.url == WORKER

    _run(redis_url, body)
