"""Streams that break: client gone, worker gone, worker down before admission, slow queue, quotas
shared by two gateway replicas. Each ends with every page free and usage metered exactly once."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from gateway.app import create_gateway_app
from gateway.generation import worker_tag
from backend.async_engine import AsyncEngine
from backend.worker import create_worker_app
from ops.redis_server import free_port
from tests.backend.servers import serve_in_thread
from tests.gateway.conftest import (MODEL, Gateway, gateway_config, make_account, metered, tiny_engine,
                                    wait_metered, wait_pages_free)
from tests.gateway.test_api import auth, run_url, sse_data


def test_client_disconnect_cancels_the_worker_request_and_meters_what_was_sent(gateway: Gateway, redis_url) -> None:
    engine = gateway.worker.engine
    received = 0
    with httpx.stream("POST", run_url(gateway), headers=auth(gateway.account.token),
                      json={"prompt": "Go on forever", "max_tokens": 400, "temperature": 0, "stream": True}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                received += 1
                if received == 3:
                    break  # leaving the block closes the connection mid-stream
    wait_pages_free(engine)
    (event,) = wait_metered(redis_url, gateway.account.tenant_id, 1)
    time.sleep(0.2)
    assert len(metered(redis_url, gateway.account.tenant_id)) == 1  # exactly once
    assert event["finish_reason"] == "cancelled"
    assert 3 <= int(event["completion_tokens"]) < 400
    assert engine.snapshot()["pages_free"] == engine.allocator.num_pages


def _start_worker_process(model_dir: Path, port: int) -> subprocess.Popen:
    env = {**os.environ, "EDGESERVE_NO_REEXEC": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "ops.cli", "serve", "--model", str(model_dir), "--served-name", MODEL, "--port", str(port),
                             "--kv-cache-bytes", "4M", "--max-model-len", "512", "--threads", "1"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()[-2000:]
        time.sleep(0.1)


def test_worker_dying_mid_stream_ends_the_stream_with_an_error_event(tiny_chat_dir, redis_url) -> None:
    port = free_port()
    proc = _start_worker_process(tiny_chat_dir, port)
    try:
        app = create_gateway_app(gateway_config(tiny_chat_dir, [f"http://127.0.0.1:{port}"], redis_url))
        account = make_account(redis_url)
        with serve_in_thread(app) as url:
            gw = Gateway(url, account, None)  # type: ignore[arg-type]
            lines: list[str] = []
            with httpx.stream("POST", run_url(gw), headers=auth(account.token),
                              json={"prompt": "x", "max_tokens": 480, "temperature": 0, "stream": True}) as resp:
                for line in resp.iter_lines():
                    lines.append(line)
                    if len(lines) == 6:
                        proc.send_signal(signal.SIGKILL)
            body = "\n".join(lines)
            assert "event: error" in body and "[DONE]" not in body
            error = json.loads(sse_data(body)[-1])
            assert error["success"] is False and error["errors"][0]["code"] == 5003
            sent = len([d for d in sse_data(body) if '"response"' in d])
            (event,) = wait_metered(redis_url, account.tenant_id, 1)
            assert event["finish_reason"] == "error" and event["error_code"] == "5003"
            assert sent <= int(event["completion_tokens"]) < 480
    finally:
        proc.kill()
        proc.wait()


def test_a_worker_down_before_admission_is_retried_on_the_next(gateway: Gateway, tiny_chat_dir, redis_url) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    app = create_gateway_app(gateway_config(tiny_chat_dir, [dead, gateway.worker.url], redis_url))
    with serve_in_thread(app) as url:
        gw = Gateway(url, gateway.account, gateway.worker)
        for _ in range(2):  # round-robin puts the dead worker first at least once
            resp = httpx.post(run_url(gw), headers=auth(gw.account.token), json={"prompt": "hi", "max_tokens": 3})
            assert resp.status_code == 200
            assert resp.headers["x-edgeserve-worker"] == worker_tag(gateway.worker.url)  # static: id = URL
    assert len(wait_metered(redis_url, gateway.account.tenant_id, 2)) == 2


def test_keepalive_comments_while_the_request_waits_in_the_queue(tiny_chat_dir, redis_url) -> None:
    engine = tiny_engine(tiny_chat_dir, max_num_seqs=1)
    with serve_in_thread(create_worker_app(AsyncEngine(engine), model_name=MODEL)) as worker_url:
        app = create_gateway_app(gateway_config(tiny_chat_dir, [worker_url], redis_url, keepalive_s=0.02))
        account = make_account(redis_url)
        with serve_in_thread(app) as url:
            gw = Gateway(url, account, None)  # type: ignore[arg-type]

            async def both() -> str:
                async with httpx.AsyncClient(timeout=60) as client:
                    body = {"prompt": "a", "max_tokens": 470, "temperature": 0, "stream": True}
                    async with client.stream("POST", run_url(gw), headers=auth(account.token), json=body) as first:
                        lines = first.aiter_lines()  # held: an abandoned iterator would close the stream
                        async for line in lines:
                            if line.startswith("data: "):
                                break  # the first request now holds the only slot for ~470 steps
                        second = await client.post(run_url(gw), headers=auth(account.token),
                                                   json={**body, "max_tokens": 2})
                        return second.text

            text = asyncio.run(both())
    head = text.split("data: ")[0]
    assert ": keep-alive" in head  # comments came before the first token
    assert sse_data(text)[-1] == "[DONE]"
    wait_pages_free(engine)


def test_quota_is_shared_by_two_gateway_replicas(worker, tiny_chat_dir, redis_url) -> None:
    account = make_account(redis_url, requests_per_minute=5)
    cfg = gateway_config(tiny_chat_dir, [worker.url], redis_url)
    with serve_in_thread(create_gateway_app(cfg)) as a, serve_in_thread(create_gateway_app(cfg)) as b:
        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=60) as client:
                calls = [client.post(run_url(Gateway(url, account, worker)), headers=auth(account.token),
                                     json={"prompt": "hi", "max_tokens": 2}) for url in [a, b] * 6]
                return await asyncio.gather(*calls)

        responses = asyncio.run(burst())
    codes = sorted(r.status_code for r in responses)
    assert codes == [200] * 5 + [429] * 7
    refused = [r for r in responses if r.status_code == 429]
    assert all(r.json()["errors"][0]["code"] == 3036 for r in refused)
    assert all(1 <= int(r.headers["retry-after"]) <= 60 for r in refused)
    assert len(wait_metered(redis_url, account.tenant_id, 5)) == 5
    wait_pages_free(worker.engine)


def test_tokens_per_day_caps_the_completion_then_refuses(gateway: Gateway, redis_url) -> None:
    account = make_account(redis_url, "capped", tokens_per_day=60)
    gw = Gateway(gateway.url, account, gateway.worker)
    first = httpx.post(run_url(gw), headers=auth(account.token),
                       json={"prompt": "hi", "max_tokens": 200, "temperature": 0})
    assert first.status_code == 200, first.text
    usage = first.json()["result"]["usage"]
    assert usage["total_tokens"] <= 60  # the grant cut max_tokens to what the day had left
    second = httpx.post(run_url(gw), headers=auth(account.token), json={"prompt": "hi", "max_tokens": 5})
    assert second.status_code == 429 and second.json()["errors"][0]["code"] == 3036
    assert 1 <= int(second.headers["retry-after"]) <= 86400
