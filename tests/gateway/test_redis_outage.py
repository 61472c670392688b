"""A gateway in front of a Redis that stops, hangs and comes back: fast typed 503s, usage metered exactly once.

Real redis-server (stopped and restarted on the same port with its data, or hung
with SIGSTOP), a real worker on the tiny chat model, the gateway on loopback."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from backend.async_engine import AsyncEngine
from backend.errors import StoreUnavailable
from backend.redis_client import connect
from backend.registration import Heartbeat, WorkerRecord
from backend.worker import create_worker_app
from gateway.app import create_gateway_app
from gateway.registry_view import RegistryView
from ops.redis_server import RedisServer
from prefix_cache.kv_events import PrefixIndex
from tests.backend.servers import serve_in_thread
from tests.gateway.conftest import (MODEL, Gateway, Worker, gateway_config, make_account, metered, tiny_engine,
                                    wait_metered)
from tests.gateway.test_api import auth, run_url

OUTAGES = ("stopped", "hung")


def _outage(redis: RedisServer, kind: str) -> None:
    redis.stop() if kind == "stopped" else redis.pause()


def _recover(redis: RedisServer, kind: str) -> None:
    redis.start() if kind == "stopped" else redis.resume()


def _gateway_app(model_dir: Path, worker_url: str, redis: RedisServer, journal: Path):
    app = create_gateway_app(gateway_config(model_dir, [worker_url], redis.url, usage_journal_path=str(journal)))
    meter = app.state.gateway.meter
    assert meter.journal_path == journal  # GatewayConfig.usage_journal_path reaches the meter
    meter.replay_interval_s = 0.1
    return app


def _assert_fast_503(resp: httpx.Response, elapsed: float, redis: RedisServer) -> None:
    assert resp.status_code == 503, resp.text
    assert elapsed < 2.0
    assert "127.0.0.1" not in resp.text and str(redis.port) not in resp.text


def test_redis_stopped_or_hung_is_a_fast_typed_503_without_its_address_then_recovers(
        worker: Worker, tiny_chat_dir: Path, restartable_redis: RedisServer, tmp_path: Path) -> None:
    redis = restartable_redis
    account = make_account(redis.url)
    body = {"prompt": "Hello", "max_tokens": 3, "temperature": 0}
    with serve_in_thread(_gateway_app(tiny_chat_dir, worker.url, redis, tmp_path / "j.jsonl")) as url:
        gw = Gateway(url, account, worker)
        assert httpx.post(run_url(gw), headers=auth(account.token), json=body, timeout=30).status_code == 200
        for kind in OUTAGES:
            _outage(redis, kind)
            try:
                for _ in range(2):  # the first call of an outage and a later one
                    t0 = time.monotonic()
                    resp = httpx.post(run_url(gw), headers=auth(account.token), json=body, timeout=30)
                    _assert_fast_503(resp, time.monotonic() - t0, redis)
                    assert resp.json()["errors"][0]["code"] == 5021, (kind, resp.text)
                    assert resp.headers["retry-after"] == "2"
                t0 = time.monotonic()
                resp = httpx.post(f"{url}/v1/chat/completions", headers=auth(account.token), timeout=30,
                                  json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
                _assert_fast_503(resp, time.monotonic() - t0, redis)
                assert resp.json()["error"]["edgeserve_code"] == 5021 and "retry-after" in resp.headers
                t0 = time.monotonic()
                health = httpx.get(f"{url}/healthz", timeout=30)
                _assert_fast_503(health, time.monotonic() - t0, redis)
            finally:
                _recover(redis, kind)
            # back by itself: no restart of the gateway, stale pooled connections replaced
            resp = httpx.post(run_url(gw), headers=auth(account.token), json=body, timeout=30)
            assert resp.status_code == 200, (kind, resp.text)
            assert httpx.get(f"{url}/healthz", timeout=30).status_code == 200


def test_healthz_during_an_outage_carries_retry_after(worker: Worker, tiny_chat_dir: Path,
                                                      restartable_redis: RedisServer, tmp_path: Path) -> None:
    with serve_in_thread(_gateway_app(tiny_chat_dir, worker.url, restartable_redis, tmp_path / "j.jsonl")) as url:
        restartable_redis.stop()
        health = httpx.get(f"{url}/healthz", timeout=30)
        assert health.status_code == 503 and "retry-after" in health.headers


def test_liveness_and_readiness_never_wait_on_redis_and_readiness_follows_the_drain(
        worker: Worker, tiny_chat_dir: Path, restartable_redis: RedisServer, tmp_path: Path) -> None:
    """An orchestrator's probes: /livez and /readyz answer 200 at once while Redis is down (an outage
    must not restart or unroute every gateway); /readyz turns 503 with Retry-After once draining."""
    app = _gateway_app(tiny_chat_dir, worker.url, restartable_redis, tmp_path / "j.jsonl")
    with serve_in_thread(app) as url:
        restartable_redis.pause()  # hung: a probe that pinged it would hang too
        try:
            for path in ("/livez", "/readyz"):
                start = time.monotonic()
                resp = httpx.get(f"{url}{path}", timeout=30)
                assert resp.status_code == 200 and time.monotonic() - start < 1.0, (path, resp.text)
        finally:
            restartable_redis.resume()
        app.state.drain.draining = True  # what SIGTERM's drain sets first
        ready = httpx.get(f"{url}/readyz", timeout=30)
        assert ready.status_code == 503 and ready.headers["retry-after"] == "1"
        assert httpx.get(f"{url}/livez", timeout=30).status_code == 200


class _GatedWorker:
    """The tiny model's worker, whose engine holds every step after the first until `release()`:
    a stream is admitted and has shown a token, and ends only when the test says."""

    def __init__(self, model_dir: Path) -> None:
        self.engine = tiny_engine(model_dir)
        self._open = threading.Event()
        original, steps = self.engine.postprocess, [0]

        def gated(batch, logits):
            steps[0] += 1
            if steps[0] > 1:
                assert self._open.wait(30), "the test never released the engine"
            return original(batch, logits)

        self.engine.postprocess = gated  # type: ignore[method-assign]
        self._steps = steps

    def hold(self) -> None:
        self._open.clear()
        self._steps[0] = 0

    def release(self) -> None:
        self._open.set()


@pytest.fixture
def gated_worker(tiny_chat_dir: Path) -> Iterator[tuple[_GatedWorker, str]]:
    gated = _GatedWorker(tiny_chat_dir)
    try:
        with serve_in_thread(create_worker_app(AsyncEngine(gated.engine), model_name=MODEL)) as url:
            yield gated, url
    finally:
        gated.release()


def _stream_through_an_outage(gw: Gateway, gated: _GatedWorker, redis: RedisServer) -> int:
    """Stream one request; Redis stops after its first token and stays down after the stream ends.

    Returns the completion tokens the stream's final usage reported."""
    gated.hold()
    body = {"prompt": "Tell me a story", "max_tokens": 20, "temperature": 0, "stream": True}
    with httpx.stream("POST", run_url(gw), headers=auth(gw.account.token), json=body, timeout=30) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        redis.stop()
        gated.release()
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    return json.loads(rest[-2][len("data: "):])["usage"]["completion_tokens"]


def test_a_stream_finished_while_redis_was_down_is_metered_once_after_it_returns_and_after_a_restart(
        gated_worker: tuple[_GatedWorker, str], tiny_chat_dir: Path, restartable_redis: RedisServer,
        tmp_path: Path) -> None:
    gated, worker_url = gated_worker
    redis, journal = restartable_redis, tmp_path / "journal.jsonl"
    account = make_account(redis.url)
    with serve_in_thread(_gateway_app(tiny_chat_dir, worker_url, redis, journal)) as url:
        gw = Gateway(url, account, Worker(worker_url, gated.engine))
        delivered = _stream_through_an_outage(gw, gated, redis)
        assert delivered > 0
        time.sleep(0.3)  # replay rounds find Redis still down
        redis.start()
        (event,) = wait_metered(redis.url, account.tenant_id, 1)  # replayed by the running gateway
        assert int(event["completion_tokens"]) == delivered and event["finish_reason"] in ("stop", "length")

        second = _stream_through_an_outage(gw, gated, redis)  # Redis down again, and the gateway stops
    assert journal.stat().st_size > 0
    redis.start()
    with serve_in_thread(_gateway_app(tiny_chat_dir, worker_url, redis, journal)):  # a restarted gateway
        events = wait_metered(redis.url, account.tenant_id, 2)
        time.sleep(0.5)  # further replay rounds change nothing
        assert len(metered(redis.url, account.tenant_id)) == 2
    assert [int(e["completion_tokens"]) for e in events] == [delivered, second]


def test_routing_reads_degrade_while_redis_hangs(restartable_redis: RedisServer) -> None:
    """The prefix index answers "no overlap" (route by load) and stops asking for a while; the
    registry view serves its last view for `stale_s`, then a typed 503."""
    record = WorkerRecord(id="w", url="http://w.invalid", role="unified", model="m", region="eu", page_size=16,
                          pages_total=100, pages_free=100, running=0, waiting=0, queued_prefill_tokens=0)

    async def main() -> None:
        hb = Heartbeat(restartable_redis.url, lambda: record, ttl_s=30)
        await hb.beat()
        await hb.redis.aclose()
        r = connect(restartable_redis.url)
        view, index = RegistryView(r, refresh_s=0.0, stale_s=1.5), PrefixIndex(r, retry_s=30)
        assert [w.id for w in await view.workers("m")] == ["w"]
        restartable_redis.pause()
        try:
            t0 = time.monotonic()
            assert await index.overlap("m", [b"x" * 8]) == {}
            assert time.monotonic() - t0 < 1.5
            t0 = time.monotonic()
            assert await index.overlap("m", [b"x" * 8]) == {}  # not asked again while retry_s runs
            assert time.monotonic() - t0 < 0.1
            assert [w.id for w in await view.workers("m")] == ["w"]  # the last view, 1 s old
            with pytest.raises(StoreUnavailable):
                await view.workers("m")  # older than stale_s now
        finally:
            restartable_redis.resume()
        assert [w.id for w in await view.workers("m")] == ["w"]
        await r.aclose()

    asyncio.run(main())


def test_the_admin_cli_names_an_unreachable_redis_without_its_password(capsys: pytest.CaptureFixture[str]) -> None:
    from ops.cli import main
    from ops.redis_server import free_port

    port = free_port()
    t0 = time.monotonic()
    assert main(["tenant", "list", "--redis-url", f"redis://:hunter2@127.0.0.1:{port}/0?password=hunter2"]) == 2
    assert time.monotonic() - t0 < 3
    err = capsys.readouterr().err
    assert "5021" in err and f"redis://127.0.0.1:{port}/0 is unreachable" in err and "hunter2" not in err
