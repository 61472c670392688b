"""Routing decisions against a real Redis with registered workers (records as workers write them)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import deque

import httpx
import pytest
import redis.asyncio as aioredis

from backend.async_engine import AsyncEngine
from backend.decode_coordinator import DecodeCoordinator
from backend.errors import BackendUnavailable, CapacityError, NoCapacity
from backend.kv_transfer import HttpKVTransport
from backend.prefix_cache_pool import KVEvent
from backend.registration import Heartbeat, WorkerRecord, record_key
from backend.worker import create_worker_app
from gateway.app import create_gateway_app
from gateway.config import GatewayConfig, ModelRoute
from gateway.generation import worker_tag
from gateway.regions import RegionMap
from gateway.registry_view import RegistryView
from gateway.router import LOAD_SLACK, LOAD_SLACK_SHARE, RECOMPUTE_WEIGHT, Router
from ops.redis_server import free_port
from prefix_cache.hashing import block_hashes
from prefix_cache.kv_events import KVEventPublisher, PrefixIndex
from tests.backend.servers import serve_in_thread
from tests.gateway.conftest import MODEL, make_account, tiny_engine, wait_pages_free
from tests.gateway.test_api import auth

REGIONS = RegionMap(latency_ms={"eu": {"us": 90.0, "ap": 200.0}, "us": {"ap": 120.0}},
                    countries={"DE": "eu", "FR": "eu", "JP": "ap"}, trust_headers=True)
PROMPT = list(range(100, 180))  # 5 full blocks of 16


def rec(wid: str, region: str = "eu", role: str = "unified", **load) -> WorkerRecord:
    base = dict(id=wid, url=f"http://{wid}.invalid", role=role, model="m", region=region, page_size=16,
                pages_total=100, pages_free=100, running=0, waiting=0, queued_prefill_tokens=0)
    base.update(load)
    return WorkerRecord(**base)


async def register(redis_url: str, *records: WorkerRecord, ttl_s: float = 30.0) -> None:
    for r in records:
        hb = Heartbeat(redis_url, lambda r=r: r, ttl_s=ttl_s)
        await hb.beat()
        await hb.redis.aclose()


async def holds(redis_url: str, worker_id: str, tenant: str, prompt: list[int], blocks: int) -> None:
    """Publish, as worker `worker_id` would, that it caches the first `blocks` blocks of `prompt`."""
    pub = KVEventPublisher(redis_url, "m", worker_id, deque([KVEvent("stored", block_hashes(prompt, 16, tenant)[:blocks])]))
    await pub.flush()
    await pub.redis.aclose()


def router(redis_url: str, policy: str = "prefix", **kw) -> tuple[Router, aioredis.Redis]:
    r = aioredis.Redis.from_url(redis_url)
    return Router(RegistryView(r, refresh_s=0.0), PrefixIndex(r), REGIONS, policy=policy, **kw), r


def test_expired_workers_are_never_routed_to(redis_url: str) -> None:
    async def go() -> None:
        rt, r = router(redis_url)
        await register(redis_url, rec("a"), ttl_s=0.3)
        assert (await rt.route("m", "t", PROMPT, 8, "eu", "r1")).candidates[0].worker.id == "a"
        await asyncio.sleep(0.5)  # no heartbeat: the record expires
        with pytest.raises(BackendUnavailable):
            await rt.route("m", "t", PROMPT, 8, "eu", "r2")
        await r.aclose()

    asyncio.run(go())


def test_nearest_region_first_then_spill_when_saturated_or_down(redis_url: str) -> None:
    async def go() -> None:
        rt, r = router(redis_url)
        await register(redis_url, rec("eu1", "eu"), rec("us1", "us"), rec("ap1", "ap"))
        d = await rt.route("m", "t", PROMPT, 8, "eu", "r1")
        assert d.candidates[0].worker.id == "eu1" and d.region == "eu"
        assert d.candidates[1].worker.id == "us1"  # the retry target: the next nearest region
        assert (await rt.route("m", "t", PROMPT, 8, "ap", "r2")).candidates[0].worker.id == "ap1"
        await register(redis_url, rec("eu1", "eu", pages_free=2))  # 32 tokens of room: saturated for 88
        d = await rt.route("m", "t", PROMPT, 8, "eu", "r3")
        assert d.candidates[0].worker.id == "us1" and "eu saturated or down" in d.reason
        await register(redis_url, rec("eu1", "eu", waiting=16))  # a full wait queue saturates too
        assert (await rt.route("m", "t", PROMPT, 8, "eu", "r4")).candidates[0].worker.id == "us1"
        await r.delete("edgeserve:{m:m}:worker:us1:record")  # us1 stops answering (expired)
        d = await rt.route("m", "t", PROMPT, 8, "eu", "r5")
        assert d.candidates[0].worker.id == "ap1"  # eu saturated, us down: ap is next
        await r.aclose()

    asyncio.run(go())


def test_a_full_wait_queue_empties_at_its_requests_first_tokens_not_at_the_next_record(redis_url: str) -> None:
    """A record's `waiting` stays until the next record; the requests it counted that have had their first token
    since are off the queue already, and so is a request sent after the record once it has had its own."""
    async def go() -> None:
        rt, r = router(redis_url, max_waiting=2)
        await register(redis_url, rec("eu1", "eu"), rec("us1", "us"))

        async def route(rid: str) -> str:
            worker = (await rt.route("m", "t", PROMPT, 8, "eu", rid)).candidates[0].worker.id
            if worker == "us1":  # us1 serves its spill at once: it never fills up itself
                rt.done(rid)
            return worker

        assert [await route(rid) for rid in ("r1", "r2", "r3")] == ["eu1", "eu1", "us1"]
        time.sleep(0.01)
        await register(redis_url, rec("eu1", "eu", waiting=2))  # written while r1 and r2 wait
        time.sleep(0.01)
        assert await route("r4") == "us1"  # full
        rt.prefilled("r1")  # eu1 admitted r1; its record still says 2 waiting
        assert await route("r5") == "eu1"
        assert await route("r6") == "us1"  # r2 and r5 wait
        rt.prefilled("r5")
        assert await route("r7") == "eu1"
        rt.done("r2")  # ended before its first token: it left the queue too
        rt.done("r7")
        assert await route("r8") == "eu1"
        await r.aclose()

    asyncio.run(go())


def test_request_region_comes_only_from_trusted_headers() -> None:
    assert REGIONS.request_region({"cf-ipcountry": "JP"}, "eu") == ("ap", "country")
    assert REGIONS.request_region({"x-edgeserve-region": "us", "cf-ipcountry": "JP"}, "eu") == ("us", "header")
    assert REGIONS.request_region({"cf-ipcountry": "ZZ"}, "eu") == ("eu", "gateway")
    untrusted = RegionMap(countries={"JP": "ap"})  # the default: a client's headers choose nothing
    assert untrusted.request_region({"cf-ipcountry": "JP", "x-edgeserve-region": "ap"}, "eu") == ("eu", "gateway")


@pytest.mark.parametrize("policy", ["prefix", "least-loaded", "round-robin"])
def test_decode_workers_without_a_live_prefill_worker_are_no_capacity_not_a_crash(redis_url: str,
                                                                                   policy: str) -> None:
    async def go() -> None:
        rt, r = router(redis_url, policy)
        await register(redis_url, rec("d1", role="decode"), rec("d2", role="decode"))
        with pytest.raises(NoCapacity, match="no prefill worker") as info:
            await rt.route("m", "t", PROMPT, 8, "eu", "r1")
        assert info.value.http_status == 503 and info.value.details["retry_after_s"] >= 1
        await register(redis_url, rec("u1", region="us"))  # a unified worker elsewhere still serves
        best = (await rt.route("m", "t", PROMPT, 8, "eu", "r2")).candidates[0]
        assert (best.worker.id, best.prefill) == ("u1", None)
        await r.aclose()

    asyncio.run(go())


def test_prefix_overlap_wins_until_the_load_outweighs_it(redis_url: str) -> None:
    async def go() -> None:
        rt, r = router(redis_url)
        await register(redis_url, rec("a"), rec("b"))
        await holds(redis_url, "b", "tenant-1", PROMPT, 4)
        d = await rt.route("m", "tenant-1", PROMPT, 8, "eu", "r1")
        assert d.candidates[0].worker.id == "b" and d.overlap_blocks == 4 and "4 cached blocks" in d.reason
        rt.done("r1")
        await register(redis_url, rec("b", queued_prefill_tokens=5000))  # b is buried in prefill work
        assert (await rt.route("m", "tenant-1", PROMPT, 8, "eu", "r2")).candidates[0].worker.id == "a"
        await r.aclose()

    asyncio.run(go())


def test_a_conversations_next_turn_is_not_pushed_off_its_worker_by_the_turn_that_just_ended(redis_url: str) -> None:
    """The record written while turn 1 ran still counts it when turn 2 arrives the moment turn 1 ends;
    the router takes ended requests off, so turn 2 goes where its prefix is cached. A request that
    ended before the record was written is not taken off twice."""
    async def go() -> None:
        rt, r = router(redis_url)
        await register(redis_url, rec("a"), rec("b"))
        await holds(redis_url, "b", "tenant-1", PROMPT, 4)
        assert (await rt.route("m", "tenant-1", PROMPT[:64], 8, "eu", "turn1")).candidates[0].worker.id == "b"
        await register(redis_url, rec("b", running=1))  # b's heartbeat while turn 1 runs
        rt.done("turn1")
        d = await rt.route("m", "tenant-1", PROMPT, 8, "eu", "turn2")
        assert d.candidates[0].worker.id == "b" and d.overlap_blocks == 4, d.reason
        rt.done("turn2")
        # a record written after both ended that still says running=3 is other requests: b is loaded
        time.sleep(0.01)
        await register(redis_url, rec("b", running=3))
        d = await rt.route("m", "tenant-1", PROMPT, 8, "eu", "turn3")
        assert d.candidates[0].worker.id == "a", d.reason  # 2 x 16 + 256 x (3 - 2 slack) on b against 2 x 80 on a
        await r.aclose()

    asyncio.run(go())


def test_load_within_the_slack_never_moves_a_cached_prefix_and_a_lasting_imbalance_does(redis_url: str) -> None:
    """A load difference of up to `load_slack` requests costs nothing against cached blocks; beyond it every
    request weighs `load_tokens`. Cold requests (nothing cached anywhere) still go to the least loaded."""
    async def go() -> None:
        picks: dict[int, str] = {}
        for slack in (0, 2):
            rt, r = router(redis_url, load_slack=slack)
            await register(redis_url, rec("a"), rec("b", running=2))
            await holds(redis_url, "b", "tenant-1", PROMPT, 4)
            d = await rt.route("m", "tenant-1", PROMPT, 8, "eu", f"s{slack}")
            picks[slack] = d.candidates[0].worker.id
            rt.done(f"s{slack}")
            await r.aclose()
        assert picks == {0: "a", 2: "b"}  # b: 2 x 16 + 256 x 2 = 544 against a's 160; with the slack b costs 32
        rt, r = router(redis_url)
        await register(redis_url, rec("a", running=1), rec("b", running=4), rec("c", running=9))
        d = await rt.route("m", "tenant-1", PROMPT, 8, "eu", "far")  # b is 3 past the least loaded: 16 + 256
        assert [t.worker.id for t in d.candidates] == ["a", "b"], d.reason  # a 160, b 288, c 160 + 256 x 6
        rt.done("far")
        await register(redis_url, rec("a", running=2), rec("b", running=1), rec("c", running=2))
        d = await rt.route("m", "tenant-2", PROMPT, 8, "eu", "cold")  # nothing cached: equal costs, load decides
        assert d.candidates[0].worker.id == "b" and d.overlap_blocks == 0, d.reason
        rt.done("cold")
        # workers running tens of requests: the slack is half the least loaded one's load (15 of 30 here)
        picks = {}
        for b_load, share in ((44, 0.5), (50, 0.5), (44, 0.0)):
            await register(redis_url, rec("a", running=30), rec("b", running=b_load), rec("c", running=60))
            rt2, r2 = router(redis_url, load_slack_share=share)
            picks[b_load, share] = (await rt2.route("m", "tenant-1", PROMPT, 8, "eu", "big")).candidates[0].worker.id
            await r2.aclose()
        assert picks == {(44, 0.5): "b", (50, 0.5): "a", (44, 0.0): "a"}  # 32 + 256 x (50 - 45) > 160 on a
        await r.aclose()
        for bad in (dict(load_slack=-1), dict(load_slack_share=-0.5)):
            with pytest.raises(ValueError, match="load_slack"):
                router(redis_url, **bad)

    asyncio.run(go())


def test_recompute_weight_keeps_a_conversation_behind_a_queue_worth_less_than_the_tokens_it_would_recompute(
        redis_url: str) -> None:
    """Cost = queued + weight x tokens to compute (+ load): a 100-token queue ahead of a 16-token remainder
    outweighs recomputing all 80 elsewhere at weight 1 (116 > 80), not at weight 2 (132 < 160). The reason names
    the runner-up's cost, overlap, queue and load: what a moved conversation's log line must explain."""
    async def go() -> None:
        await register(redis_url, rec("a", waiting=1, queued_prefill_tokens=100), rec("b"))
        await holds(redis_url, "a", "tenant-1", PROMPT, 4)
        for weight, winner, runner_up in ((1.0, "b", "next a: cost 116 (4 cached blocks, 100 queued tokens, load 1)"),
                                          (2.0, "a", "next b: cost 160 (0 cached blocks, 0 queued tokens, load 0)")):
            rt, r = router(redis_url, recompute_weight=weight)
            d = await rt.route("m", "tenant-1", PROMPT, 8, "eu", f"w{weight}")
            assert d.candidates[0].worker.id == winner and runner_up in d.reason, d.reason
            await r.aclose()
        with pytest.raises(ValueError, match="recompute_weight"):
            router(redis_url, recompute_weight=0.5)

    asyncio.run(go())


def test_prompt_tokens_leave_a_workers_queue_at_their_first_token_not_at_its_next_record(redis_url: str) -> None:
    """A record counts the prompt tokens queued when it was written; once a request dispatched before it has its
    first token (`prefilled`), its tokens come off, and one sent after the record counts only until then."""
    async def go() -> None:
        rt, r = router(redis_url, recompute_weight=1.0)  # queued and computed tokens alike, for the sums below
        await register(redis_url, rec("a"), rec("b"))
        await holds(redis_url, "a", "tenant-1", PROMPT, 4)
        assert (await rt.route("m", "tenant-9", PROMPT, 8, "eu", "t1")).candidates[0].worker.id == "a"  # cold tie
        time.sleep(0.01)
        await register(redis_url, rec("a", waiting=1, queued_prefill_tokens=80))  # written while t1 waits
        d = await rt.route("m", "tenant-1", PROMPT, 8, "eu", "t2")
        assert d.candidates[0].worker.id == "b", d.reason  # a: 80 queued + 16 against b's 80
        rt.done("t2")
        rt.prefilled("t1")  # a worked through its queue; its record still says 80
        d = await rt.route("m", "tenant-1", PROMPT, 8, "eu", "t3")
        assert d.candidates[0].worker.id == "a" and "cost 16 tokens" in d.reason, d.reason
        # t3 (16 tokens, sent after a's record) waits on a: a cold prompt costs 16 + 80 there, 80 on b
        assert (await rt.route("m", "tenant-8", PROMPT, 8, "eu", "t4")).candidates[0].worker.id == "b"
        rt.prefilled("t3")  # now b has t4's 80 waiting and a nothing
        assert (await rt.route("m", "tenant-7", PROMPT, 8, "eu", "t5")).candidates[0].worker.id == "a"
        await r.aclose()

    asyncio.run(go())


def test_the_gateways_load_slack_and_recompute_weight_reach_its_router(tiny_chat_dir, redis_url: str) -> None:
    from ops.gateway_cmd import build_config

    default = build_config(str(tiny_chat_dir), [], redis_url)
    assert (default.routing_load_slack, default.routing_load_slack_share, default.routing_recompute_weight) == (
        LOAD_SLACK, LOAD_SLACK_SHARE, RECOMPUTE_WEIGHT)
    # `edgeserve gateway --load-slack 5 --load-slack-share 0.25 --recompute-weight 1.5`
    router_ = create_gateway_app(build_config(str(tiny_chat_dir), [], redis_url, load_slack=5, load_slack_share=0.25,
                                              recompute_weight=1.5)).state.gateway.router
    assert (router_.load_slack, router_.load_slack_share, router_.recompute_weight) == (5, 0.25, 1.5)


def test_a_sole_worker_is_chosen_without_asking_the_prefix_index(redis_url: str) -> None:
    """One candidate wins whatever it caches, so the Redis lookup is skipped; a second one brings it back."""
    async def go() -> None:
        rt, r = router(redis_url)
        asked: list[int] = []
        lookup = rt.index.overlap_tiers

        async def counted(model: str, hashes: list[bytes]):
            asked.append(len(hashes))
            return await lookup(model, hashes)

        rt.index.overlap_tiers = counted
        await register(redis_url, rec("a"), rec("far", region="ap"))
        await holds(redis_url, "a", "tenant-1", PROMPT, 4)
        d = await rt.route("m", "tenant-1", PROMPT, 8, "eu", "r1")
        assert d.candidates[0].worker.id == "a" and d.candidates[1].worker.id == "far"  # fallback: next region
        assert asked == [] and d.overlap_blocks == 0 and "only candidate" in d.reason
        rt.done("r1")
        await register(redis_url, rec("b"))
        d = await rt.route("m", "tenant-1", PROMPT, 8, "eu", "r2")
        assert asked == [5] and d.candidates[0].worker.id == "a" and d.overlap_blocks == 4
        await r.aclose()

    asyncio.run(go())


def test_tenants_never_see_each_others_blocks(redis_url: str) -> None:
    async def go() -> None:
        rt, r = router(redis_url)
        await register(redis_url, rec("a"), rec("b", running=1))
        await holds(redis_url, "b", "tenant-1", PROMPT, 5)
        d = await rt.route("m", "tenant-2", PROMPT, 8, "eu", "r1")  # same prompt, another tenant
        assert d.overlap_blocks == 0 and d.candidates[0].worker.id == "a"
        assert await PrefixIndex(r).overlap("m", block_hashes(PROMPT, 16, "tenant-2")) == {}
        await r.aclose()

    asyncio.run(go())


def test_a_burst_between_heartbeats_spreads_and_policies_differ(redis_url: str) -> None:
    async def go() -> None:
        await register(redis_url, rec("a"), rec("b"), rec("c"))
        for policy in ("prefix", "least-loaded", "round-robin"):
            rt, r = router(redis_url, policy)
            picks = [(await rt.route("m", "t", PROMPT, 8, "eu", f"{policy}{i}")).candidates[0].worker.id
                     for i in range(3)]
            assert sorted(picks) == ["a", "b", "c"], (policy, picks)  # in-flight counts until the next record
            await r.aclose()

    asyncio.run(go())


def test_routes_decided_together_see_each_other_across_the_index_lookup(redis_url: str) -> None:
    """Three requests routed at once all await the prefix index; each counts what the others dispatched while it
    waited, so they spread instead of all taking the worker that looked idlest before the lookup."""
    async def go() -> None:
        await register(redis_url, rec("a"), rec("b"), rec("c"))
        rt, r = router(redis_url)
        decisions = await asyncio.gather(*(rt.route("m", "t", PROMPT, 8, "eu", f"g{i}") for i in range(3)))
        assert sorted(d.candidates[0].worker.id for d in decisions) == ["a", "b", "c"], [d.reason for d in decisions]
        await r.aclose()

    asyncio.run(go())


def test_disaggregated_pools_pair_a_prefill_worker_with_a_decode_worker(redis_url: str) -> None:
    async def go() -> None:
        rt, r = router(redis_url)
        await register(redis_url, rec("p1", role="prefill"), rec("p2", role="prefill"),
                       rec("d1", role="decode", running=3), rec("d2", role="decode"))
        await holds(redis_url, "p2", "t", PROMPT, 3)
        best = (await rt.route("m", "t", PROMPT, 8, "eu", "r1")).candidates[0]
        assert (best.worker.id, best.prefill.id) == ("d2", "p2")
        await r.aclose()

    asyncio.run(go())


def test_gateway_routes_over_the_registry_retries_before_first_byte_and_drives_a_pair(
        tiny_chat_dir, redis_url: str) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    pre_engine, dec_engine = tiny_engine(tiny_chat_dir), tiny_engine(tiny_chat_dir, kv_format="fp8_e4m3")
    a_pre, a_dec = AsyncEngine(pre_engine), AsyncEngine(dec_engine)
    # no list of its own: the router names the prefill worker, which must be registered in Redis
    coord = DecodeCoordinator(a_dec, [], HttpKVTransport(), registry_url=redis_url, model=MODEL)
    with serve_in_thread(create_worker_app(a_pre, MODEL, role="prefill")) as pre_url, \
            serve_in_thread(create_worker_app(a_dec, MODEL, role="decode", coordinator=coord)) as dec_url:
        def worker(wid, url, role, **load):
            return WorkerRecord(id=wid, url=url, role=role, model=MODEL, region="eu", page_size=16,
                                pages_total=100, pages_free=100, running=load.get("running", 0), waiting=0,
                                queued_prefill_tokens=0)

        asyncio.run(register(redis_url, worker("dead", dead, "decode"), worker("dec", dec_url, "decode", running=2),
                             worker("pre", pre_url, "prefill")))
        cfg = GatewayConfig(models=[ModelRoute(MODEL, str(tiny_chat_dir), max_model_len=512)], redis_url=redis_url,
                            region="eu", routing_policy="least-loaded")
        account = make_account(redis_url)
        app = create_gateway_app(cfg)
        with serve_in_thread(app) as url:
            resp = httpx.post(f"{url}/v1/chat/completions", headers=auth(account.token), timeout=60,
                              json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 5
        # the router heard of the first token before the end: the prompt left the prefill worker's queue then
        sent = app.state.gateway.router._inflight.ended["pre"][-1]
        assert sent.sent < sent.computed_at < sent.ended_at
        assert resp.headers["x-edgeserve-worker"] == worker_tag("dec")  # the dead (idler) worker was tried first
        assert dec_url not in resp.headers["x-edgeserve-route"]  # clients see tags, never addresses
        assert "least-loaded" in resp.headers["x-edgeserve-route"]
        stats = httpx.get(f"{dec_url}/stats").json()["kv_transfer"]
        assert stats["transfers"] == 1  # the KV came from the routed prefill worker
        wait_pages_free(dec_engine)
        wait_pages_free(pre_engine)


async def _forget(redis_url: str, key: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    await r.delete(key)
    await r.aclose()


def test_a_worker_that_refuses_for_capacity_is_retried_on_the_second_candidate(tiny_chat_dir,
                                                                              redis_url: str) -> None:
    """A 429 from a worker's full wait queue (its record, a heartbeat old, said idle) is retried once on the
    decision's second candidate; with no second candidate the client gets the 429, and nothing is metered."""
    full, spare = tiny_engine(tiny_chat_dir), tiny_engine(tiny_chat_dir)
    full.scheduler.config = dataclasses.replace(full.scheduler.config, max_waiting=0)  # refuses every request
    with serve_in_thread(create_worker_app(AsyncEngine(full), MODEL)) as full_url, \
            serve_in_thread(create_worker_app(AsyncEngine(spare), MODEL)) as spare_url:
        def worker(wid: str, url: str, running: int) -> WorkerRecord:
            return WorkerRecord(id=wid, url=url, role="unified", model=MODEL, region="eu", page_size=16,
                                pages_total=100, pages_free=100, running=running, waiting=0, queued_prefill_tokens=0)

        cfg = GatewayConfig(models=[ModelRoute(MODEL, str(tiny_chat_dir), max_model_len=512)], redis_url=redis_url,
                            region="eu", routing_policy="least-loaded")
        account = make_account(redis_url)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
        asyncio.run(register(redis_url, worker("full", full_url, 0), worker("spare", spare_url, 2)))
        with serve_in_thread(create_gateway_app(cfg)) as url:
            resp = httpx.post(f"{url}/v1/chat/completions", headers=auth(account.token), timeout=60, json=body)
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-edgeserve-worker"] == worker_tag("spare")  # "full" looked idler: tried first
        assert resp.json()["usage"]["completion_tokens"] == 5
        asyncio.run(_forget(redis_url, record_key(MODEL, "spare")))  # "spare" expired: no second candidate
        with serve_in_thread(create_gateway_app(cfg)) as url:
            refused = httpx.post(f"{url}/v1/chat/completions", headers=auth(account.token), timeout=60, json=body)
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["edgeserve_code"] == CapacityError.code
        wait_pages_free(spare)


def test_a_warm_worker_whose_pages_hold_evictable_cache_is_not_saturated(redis_url: str) -> None:
    async def go() -> None:
        rt, r = router(redis_url)
        # eu1's pool is almost all cached blocks nobody reads: room once they are evicted
        await register(redis_url, rec("eu1", "eu", pages_free=1, pages_evictable=90), rec("us1", "us"))
        await holds(redis_url, "eu1", "t", PROMPT, 4)
        d = await rt.route("m", "t", PROMPT, 8, "eu", "r1")
        assert d.candidates[0].worker.id == "eu1" and d.candidates[1].worker.id == "us1"
        await register(redis_url, rec("eu1", "eu", pages_free=1, pages_evictable=2))  # really full now
        assert (await rt.route("m", "t", PROMPT, 8, "eu", "r2")).candidates[0].worker.id == "us1"
        await r.aclose()

    asyncio.run(go())


def test_gateway_answers_503_with_retry_after_when_only_decode_workers_are_live(tiny_chat_dir,
                                                                                 redis_url: str) -> None:
    asyncio.run(register(redis_url, WorkerRecord(id="d1", url="http://d1.invalid", role="decode", model=MODEL,
                                                 region="local", page_size=16, pages_total=100, pages_free=100,
                                                 running=0, waiting=0, queued_prefill_tokens=0)))
    cfg = GatewayConfig(models=[ModelRoute(MODEL, str(tiny_chat_dir), max_model_len=512)], redis_url=redis_url)
    account = make_account(redis_url)
    with serve_in_thread(create_gateway_app(cfg)) as url:
        chat = httpx.post(f"{url}/v1/chat/completions", headers=auth(account.token), timeout=30,
                          json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})
        run = httpx.post(f"{url}/client/v4/accounts/{account.tenant_id}/ai/run/{MODEL}", headers=auth(account.token),
                         timeout=30, json={"prompt": "hi", "max_tokens": 5})
    for resp in (chat, run):
        assert resp.status_code == 503, resp.text
        assert int(resp.headers["retry-after"]) >= 1
    assert chat.json()["error"]["edgeserve_code"] == NoCapacity.code
    assert run.json()["errors"][0]["code"] == NoCapacity.code and run.json()["success"] is False
