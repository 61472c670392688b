"""Graceful drain on SIGTERM, as users run it: a real `edgeserve serve` and `edgeserve gateway` process.
Also what their start-up banners may show, and the gateway's header limits (431 in each API's form)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
import redis

from backend.async_engine import AsyncEngine
from backend.protocol import GenerateRequest
from backend.registration import members_key, record_key
from backend.sampling_params import SamplingParams
from backend.worker import create_worker_app
from ops.redis_server import free_port
from tests.backend.servers import serve_in_thread
from tests.backend.tiny_models import write_tiny_model

TOKEN = "drain-test-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
ENV = {**{k: v for k, v in os.environ.items() if k != "REDIS_URL"}, "EDGESERVE_NO_REEXEC": "1",
       "EDGESERVE_WORKER_TOKEN": TOKEN}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "m", "llama", seed=3, max_position_embeddings=1024)


def start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ops.cli", *args], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def wait_up(proc: subprocess.Popen, url: str, timeout: float = 120, any_status: bool = False) -> None:
    """Wait until `url` answers 200 (any HTTP answer with `any_status`)."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "did not start"
        try:
            status: int | None = httpx.get(url, timeout=1).status_code
        except httpx.HTTPError:
            status = None
        if status == 200 or (any_status and status is not None):
            return
        time.sleep(0.1)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def serve_args(model_dir: Path, port: int, redis_url: str, drain_timeout: float) -> list[str]:
    return ["serve", "--model", str(model_dir), "--served-name", "tiny", "--port", str(port), "--redis-url", redis_url,
            "--kv-cache-bytes", "4M", "--max-model-len", "1024", "--threads", "1", "--gemm-buckets", "none",
            "--drain-timeout", str(drain_timeout)]


def generate_body(max_tokens: int) -> bytes:
    return msgspec.json.encode(GenerateRequest([3, 4, 5, 6], SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                             ignore_eos=True), model="tiny"))


@pytest.fixture
def worker(model_dir: Path, redis_url: str, request: pytest.FixtureRequest) -> Iterator[tuple[subprocess.Popen, str]]:
    port = free_port()
    proc = start(serve_args(model_dir, port, redis_url, request.param))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_up(proc, f"{url}/health")
        yield proc, url
    finally:
        stop(proc)


@pytest.mark.parametrize("worker", [30.0], indirect=True)
def test_sigterm_deregisters_refuses_new_work_finishes_the_stream_and_exits_0(worker, redis_url: str) -> None:
    proc, url = worker
    r = redis.Redis.from_url(redis_url)
    wid = url.removeprefix("http://")
    deadline = time.monotonic() + 10
    while not r.exists(record_key("tiny", wid)):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with httpx.stream("POST", f"{url}/v1/generate", content=generate_body(900), headers=AUTH, timeout=60) as stream:
        lines = stream.iter_lines()
        next(lines)  # the request is running
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        while r.exists(record_key("tiny", wid)) or r.sismember(members_key("tiny"), wid):
            assert time.monotonic() - signalled < 2, "still registered: routers would keep sending"
            time.sleep(0.02)
        refused = httpx.post(f"{url}/v1/generate", content=generate_body(4), headers=AUTH, timeout=10)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == 5005  # Draining
        assert int(refused.headers["retry-after"]) >= 1
        health = httpx.get(f"{url}/health", timeout=10)
        assert (health.status_code, health.json()["status"]) == (503, "draining")
        events = [json.loads(line) for line in lines if line.strip()]
    assert len(events) > 1, "the stream had ended before the drain began; the test proves nothing"
    assert events[-1]["event"] == "finish" and events[-1]["finish_reason"] == "length"
    assert events[-1]["completion_tokens"] == 900
    assert proc.wait(timeout=15) == 0
    r.close()


@pytest.mark.parametrize("worker", [0.3], indirect=True)
def test_requests_still_running_at_the_drain_timeout_end_with_draining(worker) -> None:
    proc, url = worker
    with httpx.stream("POST", f"{url}/v1/generate", content=generate_body(1000), headers=AUTH, timeout=60) as stream:
        lines = stream.iter_lines()
        next(lines)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        events = [json.loads(line) for line in lines if line.strip()]
    assert events[-1]["event"] == "error" and events[-1]["code"] == 5005, events[-1]
    assert 0 < events[-1]["completion_tokens"] < 1000
    assert proc.wait(timeout=15) == 0
    assert time.monotonic() - started < 10


def test_serve_refuses_a_public_address_without_a_worker_token(model_dir: Path) -> None:
    env = {k: v for k, v in ENV.items() if k != "EDGESERVE_WORKER_TOKEN"}
    done = subprocess.run([sys.executable, "-m", "ops.cli", "serve", "--model", str(model_dir), "--host", "0.0.0.0",
                           "--port", str(free_port())], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "without a worker token" in done.stderr


# -- the gateway ---------------------------------------------------------------------------

def test_gateway_banner_hides_the_redis_password_and_sigterm_exits_0(tiny_chat_dir: Path) -> None:
    port = free_port()
    proc = start(["gateway", "--model", str(tiny_chat_dir), "--served-name", "tiny-chat", "--port", str(port),
                  "--redis-url", "redis://:hunter2@127.0.0.1:6390/0"])  # no Redis there: it is never reached
    try:
        banner = proc.stdout.readline()
        assert "registry in redis://127.0.0.1:6390/0" in banner and "hunter2" not in banner, banner
        wait_up(proc, f"http://127.0.0.1:{port}/v1/models", any_status=True)  # 401 without a key
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        stop(proc)


def test_gateway_drain_ends_open_streams_with_an_in_stream_draining_error(tiny_chat_dir: Path,
                                                                           redis_url: str) -> None:
    from tests.gateway.conftest import make_account, tiny_engine

    engine = tiny_engine(tiny_chat_dir)
    step = engine.step

    def slow_step():  # ~20 ms a token: the stream is still open when the drain times out
        time.sleep(0.02)
        return step()

    engine.step = slow_step
    with serve_in_thread(create_worker_app(AsyncEngine(engine), model_name="tiny-chat")) as worker_url:
        port = free_port()
        proc = start(["gateway", "--model", str(tiny_chat_dir), "--served-name", "tiny-chat", "--port", str(port),
                      "--worker", worker_url, "--redis-url", redis_url, "--drain-timeout", "0.5"])
        base = f"http://127.0.0.1:{port}"
        try:
            wait_up(proc, f"{base}/healthz")
            account = make_account(redis_url)
            headers = {"authorization": f"Bearer {account.token}"}
            run = f"{base}/client/v4/accounts/{account.tenant_id}/ai/run/tiny-chat"
            with httpx.stream("POST", run, headers=headers, timeout=60,
                              json={"prompt": "hi", "stream": True, "max_tokens": 400}) as stream:
                lines = stream.iter_lines()
                first = next(line for line in lines if line.startswith("data:"))
                proc.send_signal(signal.SIGTERM)
                time.sleep(0.1)
                refused = httpx.post(f"{base}/v1/chat/completions", headers=headers, timeout=10,
                                     json={"model": "tiny-chat", "messages": [{"role": "user", "content": "x"}]})
                rest = [line for line in lines if line.startswith("data:")]
            assert first and rest
            assert refused.status_code == 503 and refused.json()["error"]["edgeserve_code"] == 5005
            assert "retry-after" in refused.headers
            assert any("5005" in line for line in rest), rest[-3:]  # the open stream ended with Draining
            assert proc.wait(timeout=15) == 0
        finally:
            stop(proc)


def test_gateway_answers_431_in_each_apis_form(tiny_chat_dir: Path, redis_url: str) -> None:
    from gateway.app import create_gateway_app
    from tests.gateway.conftest import gateway_config

    app = create_gateway_app(gateway_config(tiny_chat_dir, ["http://127.0.0.1:9"], redis_url))

    async def go() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
        big = {"authorization": "Bearer x", "x-big": "a" * (2**20)}  # a 1 MB header
        many = {f"x-h{i}": "v" for i in range(150)}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gw") as client:
            return (await client.post("/client/v4/accounts/a/ai/run/tiny-chat", headers=big, json={}),
                    await client.post("/v1/chat/completions", headers=big, json={}),
                    await client.get("/v1/models", headers=many))

    workers, openai, many = asyncio.run(go())
    assert workers.status_code == 431 and workers.json()["errors"][0]["code"] == 3000
    assert workers.json()["success"] is False
    assert openai.status_code == 431 and openai.json()["error"]["type"] == "invalid_request_error"
    assert many.status_code == 431
