"""The worker boundary: the worker token, caller-scoped cancels, the prefill_url allowlist, header
limits, and a dead engine thread that fails loudly. Real loopback servers, tiny random models, real Redis."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
import redis

from backend.async_engine import AsyncEngine
from backend.decode_coordinator import DecodeCoordinator
from backend.engine import EngineConfig, LLMEngine
from backend.errors import AuthenticationError, InvalidRequest
from backend.http_limits import HeaderLimits, guarded_http_protocol
from backend.kv_transfer import HttpKVTransport, PrefillRequest
from backend.protocol import ErrorEvent, FinishEvent, GenerateRequest, TokenEvent
from backend.registration import Heartbeat, WorkerRecord, members_key, record_key
from backend.sampling_params import SamplingParams
from backend.worker import create_worker_app, worker_error_response
from backend.worker_client import WorkerClient
from tests.backend.servers import free_port, serve_in_thread
from tests.backend.tiny_models import write_tiny_model

TOKEN = "s3cret-worker-token"
GREEDY = dict(temperature=0.0, ignore_eos=True)
PROMPT = [(5 * i) % 300 + 3 for i in range(20)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "m", "llama", seed=11)


def engine(model_dir: Path, kv_format: str = "fp32") -> LLMEngine:
    return LLMEngine.from_pretrained(model_dir, EngineConfig(kv_cache_bytes=2**20, page_size=16, max_model_len=256,
                                                             gemm_buckets=(), kv_format=kv_format))


@pytest.fixture(scope="module")
def guarded(model_dir: Path) -> Iterator[tuple[str, LLMEngine]]:
    """A unified worker with a token, served with the header-guarding HTTP protocol."""
    eng = engine(model_dir)
    app = create_worker_app(AsyncEngine(eng), "tiny", token=TOKEN)
    with serve_in_thread(app, http=guarded_http_protocol(HeaderLimits(), worker_error_response)) as url:
        yield url, eng


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


async def collect(client: WorkerClient, req: GenerateRequest) -> list:
    try:
        return [ev async for ev in client.generate(req)]
    finally:
        await client.aclose()


def tokens(events: list) -> list[int]:
    return [t for ev in events if isinstance(ev, TokenEvent) for t in ev.token_ids]


# -- the worker token ----------------------------------------------------------------------

@pytest.mark.parametrize("headers", [{}, bearer("wrong"), {"authorization": TOKEN}], ids=["none", "wrong", "bare"])
def test_every_worker_call_without_the_token_is_401_and_runs_nothing(guarded, headers) -> None:
    url, eng = guarded
    body = msgspec.json.encode(GenerateRequest(PROMPT, SamplingParams(max_tokens=4), "r-auth"))
    prefill = msgspec.json.encode(PrefillRequest(PROMPT, SamplingParams(max_tokens=4), "p-auth"))
    calls = [("POST", "/v1/generate", body), ("POST", "/v1/prefill", prefill),
             ("POST", "/v1/cancel/r-auth", b'{"cancel_key": "k"}'), ("GET", "/stats", None), ("GET", "/metrics", None)]
    computed = eng.stats["prompt_tokens"]
    for method, path, content in calls:
        resp = httpx.request(method, f"{url}{path}", content=content, headers=headers)
        assert resp.status_code == 401, (path, resp.text)
        assert resp.json()["error"]["code"] == AuthenticationError.code
    time.sleep(0.1)
    assert eng.stats["prompt_tokens"] == computed  # no prompt reached the engine
    assert httpx.get(f"{url}/health").status_code == 200  # open: reveals nothing


def test_the_token_holder_is_served(guarded) -> None:
    url, eng = guarded
    events = asyncio.run(collect(WorkerClient(url, token=TOKEN),
                                 GenerateRequest(PROMPT, SamplingParams(max_tokens=5, **GREEDY), "r-ok")))
    assert len(tokens(events)) == 5 and isinstance(events[-1], FinishEvent)
    assert httpx.get(f"{url}/stats", headers=bearer(TOKEN)).json()["pages_total"] == eng.allocator.num_pages


# -- caller-scoped cancel ------------------------------------------------------------------

def test_cancel_needs_the_callers_key(guarded) -> None:
    url, eng = guarded

    async def run() -> tuple[list, list[int]]:
        client = WorkerClient(url, token=TOKEN)
        events, statuses = [], []
        req = GenerateRequest(PROMPT, SamplingParams(max_tokens=60, **GREEDY), "victim", cancel_key="right-key")
        async with httpx.AsyncClient(headers=bearer(TOKEN)) as other:
            async for ev in client.generate(req):
                events.append(ev)
                if len(events) == 2:  # another token holder guesses the id, with a wrong key and with none
                    for body in (b'{"cancel_key": "guess"}', b"{}"):
                        statuses.append((await other.post(f"{url}/v1/cancel/victim", content=body)).status_code)
        await client.aclose()
        return events, statuses

    events, statuses = asyncio.run(run())
    assert statuses == [400, 400]
    assert isinstance(events[-1], FinishEvent) and events[-1].finish_reason == "length"
    assert len(tokens(events)) == 60  # nothing was cancelled


def test_the_caller_cancels_with_the_key_its_client_made(guarded) -> None:
    url, eng = guarded

    async def run() -> list:
        client = WorkerClient(url, token=TOKEN)
        events = []
        async for ev in client.generate(GenerateRequest(PROMPT, SamplingParams(max_tokens=200, **GREEDY), "mine")):
            events.append(ev)
            if len(events) == 2:
                assert await client.cancel("mine")
        await client.aclose()
        return events

    events = asyncio.run(run())
    assert events[-1].finish_reason == "cancelled" and events[-1].completion_tokens < 200


# -- header limits ---------------------------------------------------------------------------

def test_oversized_or_too_many_headers_are_431_in_the_workers_error_form(guarded) -> None:
    url, _ = guarded
    for headers in ({"x-big": "a" * 40_000}, {f"x-h{i}": "v" for i in range(120)}):
        resp = httpx.get(f"{url}/health", headers=headers)
        assert resp.status_code == 431
        assert resp.json()["error"]["code"] == InvalidRequest.code
    assert httpx.get(f"{url}/health", headers={"x-ok": "a" * 1000}).status_code == 200


def test_a_huge_header_is_refused_before_it_is_all_received(guarded) -> None:
    url, _ = guarded
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * (3 * 2**20 // 2))  # 1.5 MB, never ended
        reply = s.recv(4096)
    assert reply.startswith(b"HTTP/1.1 431 "), reply[:100]
    assert b'"code":3000' in reply


# -- prefill_url allowlist and the prefill token -------------------------------------------

@contextlib.contextmanager
def decode_pair(model_dir: Path, redis_url: str, transport_token: str | None = TOKEN
                ) -> Iterator[tuple[str, str, LLMEngine]]:
    """A prefill worker (token) and a decode worker with no list of its own, reading the registry."""
    pre, dec = engine(model_dir, "bf16"), engine(model_dir, "fp8_e4m3")
    adec = AsyncEngine(dec)
    coord = DecodeCoordinator(adec, [], HttpKVTransport(token=transport_token), registry_url=redis_url, model="tiny",
                              reserve_timeout_s=1.0, transfer_timeout_s=10.0)
    with serve_in_thread(create_worker_app(AsyncEngine(pre), "tiny", role="prefill", token=TOKEN)) as pre_url, \
            serve_in_thread(create_worker_app(adec, "tiny", role="decode", coordinator=coord, token=TOKEN)) as dec_url:
        yield pre_url, dec_url, dec


def register(redis_url: str, wid: str, url: str, role: str) -> None:
    rec = WorkerRecord(id=wid, url=url, role=role, model="tiny", region="local", page_size=16, pages_total=64,
                       pages_free=64, running=0, waiting=0, queued_prefill_tokens=0, updated_at=time.time())
    r = redis.Redis.from_url(redis_url)
    r.set(record_key("tiny", wid), msgspec.json.encode(rec), px=30_000)
    r.sadd(members_key("tiny"), wid)
    r.close()


def test_prefill_url_must_be_a_registered_prefill_worker(model_dir: Path, redis_url: str) -> None:
    trap = socket.socket()  # a listener at the URL an attacker names: it must never be connected to
    trap.bind(("127.0.0.1", 0))
    trap.listen(8)
    trap.settimeout(0.3)
    trap_url = f"http://127.0.0.1:{trap.getsockname()[1]}"
    with decode_pair(model_dir, redis_url) as (pre_url, dec_url, dec):
        register(redis_url, "pre", pre_url, "prefill")
        register(redis_url, "looks-like-one", trap_url, "decode")  # registered, but not as a prefill worker
        for bad in (trap_url, f"{trap_url}/", "http://169.254.169.254"):
            req = GenerateRequest(PROMPT, SamplingParams(max_tokens=4, **GREEDY), prefill_url=bad)
            resp = httpx.post(f"{dec_url}/v1/generate", content=msgspec.json.encode(req), headers=bearer(TOKEN))
            assert resp.status_code == 400, resp.text
            assert resp.json()["error"]["field"] == "prefill_url"
        with pytest.raises(TimeoutError):
            trap.accept()
        trap.close()
        # the registered prefill worker is accepted, and the transfer carries the token
        events = asyncio.run(collect(WorkerClient(dec_url, token=TOKEN),
                                     GenerateRequest(PROMPT, SamplingParams(max_tokens=4, **GREEDY),
                                                     prefill_url=pre_url)))
        assert len(tokens(events)) == 4 and isinstance(events[-1], FinishEvent)


def test_a_decode_worker_without_the_prefill_token_gets_a_typed_refusal(model_dir: Path, redis_url: str) -> None:
    with decode_pair(model_dir, redis_url, transport_token="wrong") as (pre_url, dec_url, dec):
        register(redis_url, "pre", pre_url, "prefill")
        events = asyncio.run(collect(WorkerClient(dec_url, token=TOKEN),
                                     GenerateRequest(PROMPT, SamplingParams(max_tokens=4, **GREEDY),
                                                     prefill_url=pre_url)))
        assert tokens(events) == [] and isinstance(events[-1], ErrorEvent)
        assert events[-1].code == AuthenticationError.code


# -- a dead engine thread ----------------------------------------------------------------------

def _record(wid: str, url: str) -> WorkerRecord:
    return WorkerRecord(id=wid, url=url, role="unified", model="tiny", region="local", page_size=16,
                        pages_total=64, pages_free=64, running=0, waiting=0, queued_prefill_tokens=0)


def _kill_engine_and_wait_registered(eng: LLMEngine, url: str, r: redis.Redis) -> None:
    deadline = time.monotonic() + 10
    while not r.exists(record_key("tiny", "w1")):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert httpx.get(f"{url}/health").status_code == 200

    def boom() -> None:
        raise RuntimeError("injected: the engine's step blew up")

    eng.step = boom  # the next step kills the engine thread


@contextlib.contextmanager
def registered_worker(model_dir: Path, redis_url: str) -> Iterator[tuple[str, LLMEngine, redis.Redis]]:
    eng = engine(model_dir)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    beat = Heartbeat(redis_url, lambda: _record("w1", url), interval_s=0.1, ttl_s=60)  # no expiry in the test
    r = redis.Redis.from_url(redis_url)
    with serve_in_thread(create_worker_app(AsyncEngine(eng), "tiny", registration=beat.run), port=port):
        _kill_engine_and_wait_registered(eng, url, r)
        yield url, eng, r
    r.close()


def test_a_dead_engine_thread_fails_health_and_leaves_the_registry(model_dir: Path, redis_url: str) -> None:
    with registered_worker(model_dir, redis_url) as (url, eng, r):
        body = msgspec.json.encode(GenerateRequest(PROMPT, SamplingParams(max_tokens=4, **GREEDY)))
        with contextlib.suppress(httpx.TimeoutException):  # the request that kills it (its ending: next test)
            httpx.post(f"{url}/v1/generate", content=body, timeout=1)
        deadline = time.monotonic() + 2
        while r.exists(record_key("tiny", "w1")) or r.sismember(members_key("tiny"), "w1"):
            assert time.monotonic() < deadline, "the dead worker is still registered"
            time.sleep(0.05)
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and health.json()["status"] == "failed"


def test_a_dead_engine_ends_waiting_requests_at_once_and_refuses_new_ones(model_dir: Path, redis_url: str) -> None:
    with registered_worker(model_dir, redis_url) as (url, eng, r):
        started = time.monotonic()
        events = asyncio.run(asyncio.wait_for(collect(WorkerClient(url), GenerateRequest(
            PROMPT, SamplingParams(max_tokens=4, **GREEDY))), timeout=10))
        assert isinstance(events[-1], ErrorEvent) and time.monotonic() - started < 5
        resp = httpx.post(f"{url}/v1/generate", content=msgspec.json.encode(GenerateRequest(PROMPT)))
        assert resp.status_code == 503 and resp.json()["error"]["code"] == 5004  # EngineStopped
