"""A request's event stream ends its request whenever its reader lets go: closed before the first
read, its reader cancelled mid-read, or (worker HTTP) the client gone before the
response's first byte. A stream closed after its request ended touches nothing else."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from starlette.requests import ClientDisconnect

from backend.async_engine import AsyncEngine
from backend.engine import EngineConfig, LLMEngine
from backend.protocol import FinishEvent, TokenEvent
from backend.sampling_params import SamplingParams
from backend.worker import create_worker_app
from tests.backend.tiny_models import write_tiny_model

PROMPT = [(7 * i) % 300 + 3 for i in range(20)]
LONG = SamplingParams(max_tokens=240, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("event-stream") / "m", "llama", seed=5)


@pytest.fixture
def aengine(model_dir: Path) -> Iterator[AsyncEngine]:
    cfg = EngineConfig(dtype="float32", kv_format="fp32", kv_cache_bytes=2**20, page_size=16, max_model_len=512,
                       gemm_buckets=())
    aengine = AsyncEngine(LLMEngine.from_pretrained(model_dir, cfg))
    try:
        yield aengine
    finally:
        aengine.shutdown()


async def wait_idle(engine: LLMEngine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.allocator.num_free != engine.allocator.num_pages or engine.has_work():
        assert time.monotonic() < deadline, engine.snapshot()
        await asyncio.sleep(0.01)


async def until_running(engine: LLMEngine, n: int = 1) -> None:
    deadline = time.monotonic() + 10
    while len(engine.scheduler.running) < n:
        assert time.monotonic() < deadline, engine.snapshot()
        await asyncio.sleep(0.005)


def test_a_stream_closed_before_its_first_read_aborts_its_request(aengine: AsyncEngine) -> None:
    engine = aengine.engine

    async def scenario() -> None:
        stream = aengine.submit(PROMPT, LONG, "never-read")
        await until_running(engine)
        await stream.aclose()
        assert aengine.num_active() == 0
        await wait_idle(engine)
        assert [ev async for ev in stream] == []  # closed: nothing more comes out

    asyncio.run(asyncio.wait_for(scenario(), 20))
    assert engine.stats["cancelled"] == 1


def test_a_reader_cancelled_mid_read_aborts_the_request(aengine: AsyncEngine) -> None:
    engine = aengine.engine

    async def scenario() -> int:
        stream = aengine.submit(PROMPT, LONG)
        tokens = 0

        async def read() -> None:
            nonlocal tokens
            async for ev in stream:
                tokens += len(ev.token_ids) if isinstance(ev, TokenEvent) else 0

        reader = asyncio.ensure_future(read())
        while tokens < 3:
            await asyncio.sleep(0.005)
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        assert aengine.num_active() == 0
        await wait_idle(engine)
        return tokens

    tokens = asyncio.run(asyncio.wait_for(scenario(), 20))
    assert 3 <= tokens < LONG.max_tokens
    assert engine.stats["cancelled"] == 1 and aengine.num_active() == 0


def test_closing_a_stream_whose_request_ended_leaves_a_later_request_with_its_id_alone(aengine: AsyncEngine) -> None:
    async def scenario() -> list:
        first = aengine.submit(PROMPT, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), "reused")
        while aengine.num_active():  # its final event is queued, unread
            await asyncio.sleep(0.005)
        second = aengine.submit(PROMPT, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), "reused")
        await first.aclose()
        return [ev async for ev in second]

    events = asyncio.run(asyncio.wait_for(scenario(), 20))
    assert isinstance(events[-1], FinishEvent)
    assert (events[-1].finish_reason, events[-1].completion_tokens) == ("length", 40)
    assert aengine.engine.stats["cancelled"] == 0


@pytest.mark.parametrize("server", ["send-raises", "disconnect-queued"])
def test_a_worker_client_gone_before_the_first_byte_cancels_its_request(aengine: AsyncEngine, server: str) -> None:
    """ASGI 2.4 servers raise OSError from `send` to a gone client (the body never starts); with 2.3 ones
    the disconnect waits in `receive` when the response starts."""
    engine = aengine.engine
    app = create_worker_app(aengine, model_name="tiny")

    def body(max_tokens: int) -> bytes:
        return msgspec.json.encode({"prompt_ids": PROMPT, "request_id": "gone", "cancel_key": "k",
                                    "params": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}})

    async def call(max_tokens: int, gone: bool) -> list[dict]:
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4" if gone and server == "send-raises"
                                          else "2.3"},
                 "http_version": "1.1", "method": "POST", "scheme": "http", "path": "/v1/generate",
                 "raw_path": b"/v1/generate", "query_string": b"", "root_path": "",
                 "headers": [(b"content-type", b"application/json")],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
        pending, sent = [{"type": "http.request", "body": body(max_tokens), "more_body": False}], []
        if gone:
            pending.append({"type": "http.disconnect"})

        async def receive() -> dict:
            if pending:
                return pending.pop(0)
            await asyncio.sleep(3600)
            raise AssertionError("unreachable")

        async def send(message: dict) -> None:
            if gone and server == "send-raises":
                raise OSError("the client is gone")
            sent.append(message)

        try:
            await app(scope, receive, send)
        except ClientDisconnect:
            assert gone and server == "send-raises"
        return sent

    async def scenario() -> list[dict]:
        await call(240, gone=True)
        assert aengine.num_active() == 0
        await wait_idle(engine)
        return await call(3, gone=False)  # its cancel key went with it: the same id is accepted again

    sent = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert engine.stats["cancelled"] == 1
    assert sent[0]["status"] == 200
    lines = b"".join(m.get("body", b"") for m in sent[1:]).splitlines()
    assert msgspec.json.decode(lines[-1])["completion_tokens"] == 3
