"""The worker HTTP API on a real loopback server, tiny random model."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import httpx
import pytest

from backend.async_engine import AsyncEngine
from backend.engine import EngineConfig, LLMEngine
from backend.errors import CapacityError, InvalidRequest, InvalidSamplingParams, ModelNotFound, PromptTooLong
from backend.protocol import ErrorEvent, FinishEvent, GenerateRequest, TokenEvent
from backend.sampling_params import SamplingParams
from backend.worker import create_worker_app
from backend.worker_client import WorkerClient
from tests.backend.servers import serve_in_thread
from tests.backend.tiny_models import write_tiny_model

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory):
    path = write_tiny_model(tmp_path_factory.mktemp("tiny") / "m", "llama", seed=11)
    cfg = EngineConfig(dtype="float32", kv_format="fp32", kv_cache_bytes=2**20, page_size=16, max_waiting=8,
                       max_model_len=256)
    engine = LLMEngine.from_pretrained(path, cfg)
    with serve_in_thread(create_worker_app(AsyncEngine(engine), model_name="tiny")) as url:
        yield url, engine


async def collect(url: str, req: GenerateRequest) -> list:
    client = WorkerClient(url)
    try:
        return [ev async for ev in client.generate(req)]
    finally:
        await client.aclose()


def wait_idle(engine: LLMEngine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.allocator.num_free != engine.allocator.num_pages or engine.has_work():
        assert time.monotonic() < deadline, engine.snapshot()
        time.sleep(0.02)


def test_generate_streams_tokens_then_one_finish(worker) -> None:
    url, engine = worker
    events = asyncio.run(collect(url, GenerateRequest([5, 6, 7, 8], SamplingParams(max_tokens=9, **GREEDY))))
    tokens = [t for ev in events if isinstance(ev, TokenEvent) for t in ev.token_ids]
    assert len(tokens) == 9 and isinstance(events[-1], FinishEvent)
    fin = events[-1]
    assert (fin.finish_reason, fin.prompt_tokens, fin.completion_tokens) == ("length", 4, 9)
    times = [t for ev in events if isinstance(ev, TokenEvent) for t in ev.times]
    assert times == sorted(times) and times[0] == pytest.approx(fin.ttft_s, abs=1e-6)
    # the same request again is deterministic (greedy)
    again = asyncio.run(collect(url, GenerateRequest([5, 6, 7, 8], SamplingParams(max_tokens=9, **GREEDY))))
    assert tokens == [t for ev in again if isinstance(ev, TokenEvent) for t in ev.token_ids]
    wait_idle(engine)


def test_a_request_read_whole_gets_the_same_events(worker) -> None:
    """`stream=False` only changes how the lines are written (held together, `event_frames.py`)."""
    url, engine = worker
    params = SamplingParams(max_tokens=9, logprobs=2, **GREEDY)
    streamed = asyncio.run(collect(url, GenerateRequest([5, 6, 7, 8], params)))
    whole = asyncio.run(collect(url, GenerateRequest([5, 6, 7, 8], params, stream=False)))

    def ids(events: list) -> list[int]:
        return [t for ev in events if isinstance(ev, TokenEvent) for t in ev.token_ids]

    assert len(ids(whole)) == 9 and ids(whole) == ids(streamed)
    assert [lp for ev in whole if isinstance(ev, TokenEvent) for lp in ev.logprobs.token] == pytest.approx(
        [lp for ev in streamed if isinstance(ev, TokenEvent) for lp in ev.logprobs.token])
    assert isinstance(whole[-1], FinishEvent) and whole[-1].completion_tokens == 9
    wait_idle(engine)


def test_concurrent_requests_each_get_their_own_stream(worker) -> None:
    url, engine = worker

    async def many():
        reqs = [GenerateRequest([3 + i, 4, 5], SamplingParams(max_tokens=5 + i, **GREEDY)) for i in range(6)]
        return await asyncio.gather(*(collect(url, r) for r in reqs))

    results = asyncio.run(many())
    for i, events in enumerate(results):
        assert sum(len(ev.token_ids) for ev in events if isinstance(ev, TokenEvent)) == 5 + i
        assert events[-1].completion_tokens == 5 + i
    wait_idle(engine)


@pytest.mark.parametrize("body,status,code", [
    (b"{not json", 400, InvalidRequest.code),
    (b'{"prompt_ids": "abc"}', 400, InvalidRequest.code),
    (b'{"prompt_ids": [1, 2], "params": {"temperature": -3}}', 400, InvalidSamplingParams.code),
    (b'{"prompt_ids": [1, 2], "params": {"max_tokens": 1000}}', 413, PromptTooLong.code),
    (b'{"prompt_ids": [1, 2], "model": "other"}', 400, ModelNotFound.code),
    (b'{"prompt_ids": [1, 99999]}', 400, InvalidRequest.code),
])
def test_bad_requests_get_typed_errors(worker, body: bytes, status: int, code: int) -> None:
    url, engine = worker
    resp = httpx.post(f"{url}/v1/generate", content=body)
    assert resp.status_code == status
    assert resp.json()["error"]["code"] == code
    assert engine.snapshot()["pages_free"] == engine.allocator.num_pages


def test_queue_full_is_429_and_the_client_raises_capacity_error(worker) -> None:
    url, engine = worker

    async def flood():
        reqs = [GenerateRequest([3, 4, 5], SamplingParams(max_tokens=200, **GREEDY)) for _ in range(40)]
        return await asyncio.gather(*(collect(url, r) for r in reqs), return_exceptions=True)

    results = asyncio.run(flood())
    refused = [r for r in results if isinstance(r, CapacityError)]
    served = [r for r in results if isinstance(r, list)]
    assert refused and served and len(refused) + len(served) == 40
    assert all(r[-1].completion_tokens == 200 for r in served)
    wait_idle(engine)


def test_client_disconnect_cancels_and_frees_pages(worker) -> None:
    url, engine = worker
    with httpx.Client(timeout=10) as client:
        with client.stream("POST", f"{url}/v1/generate",
                           content=b'{"prompt_ids": [7, 8, 9], "params": {"max_tokens": 240, "temperature": 0}}') as r:
            lines = r.iter_lines()
            next(lines)
            next(lines)
            assert engine.allocator.num_free < engine.allocator.num_pages
        # leaving the block closes the connection mid-stream
    wait_idle(engine)
    assert engine.stats["cancelled"] >= 1


def test_cancel_endpoint_ends_the_stream_with_cancelled(worker) -> None:
    url, engine = worker

    async def run():
        client = WorkerClient(url)
        events = []
        async for ev in client.generate(GenerateRequest([3, 4], SamplingParams(max_tokens=240, **GREEDY),
                                                        request_id="to-cancel")):
            events.append(ev)
            if len(events) == 2:
                await client.cancel("to-cancel")
        await client.aclose()
        return events

    events = asyncio.run(run())
    assert isinstance(events[-1], FinishEvent) and events[-1].finish_reason == "cancelled"
    assert events[-1].completion_tokens < 240
    assert not any(isinstance(e, ErrorEvent) for e in events)
    wait_idle(engine)


def test_health_and_stats(worker) -> None:
    url, engine = worker
    assert httpx.get(f"{url}/health").json() == {"status": "ok", "role": "unified", "model": "tiny"}
    stats = httpx.get(f"{url}/stats").json()
    assert stats["pages_total"] == engine.allocator.num_pages
    assert {"running", "waiting", "pages_free", "pages_used", "kv_bytes_per_token"} <= stats.keys()
    metrics = httpx.get(f"{url}/metrics").text
    assert f'edgeserve_kv_pages_total{{model="tiny",role="unified"}} {float(engine.allocator.num_pages)}' in metrics
    assert (f'edgeserve_kv_bytes_per_token{{kv_format="fp32",model="tiny",role="unified"}} '
            f'{float(engine.cache.bytes_per_token)}') in metrics
    assert "edgeserve_generated_tokens_total" in metrics
    assert 'edgeserve_kv_integrity_aborts_total{cause="tag_mismatch",model="tiny",role="unified"} 0.0' in metrics
    checks = [line for line in metrics.splitlines() if line.startswith("edgeserve_kv_integrity_checks_total")]
    assert checks and float(checks[0].split()[-1]) == engine.stats["integrity_checks"]


def test_tenants_share_admission_and_the_wait_queue(worker) -> None:
    """The gateway's tenant (`cache_salt`) reaches the scheduler: with one running slot, a request of tenant b
    sent after tenant a's five runs second, not last; and tenant a may hold 6 of the 8 places of the queue."""
    url, engine = worker
    before = engine.scheduler.config
    engine.scheduler.config = dataclasses.replace(before, max_num_seqs=1)

    async def go() -> tuple[list[str], list]:
        done: list[str] = []

        async def one(name: str, salt: str, n: int) -> list:
            events = await collect(url, GenerateRequest([5, 6, 7, 8], SamplingParams(max_tokens=n, **GREEDY),
                                                        cache_salt=salt))
            done.append(name)
            return events

        flood = [asyncio.create_task(one(f"a{i}", "a", 40)) for i in range(5)]
        while not (engine.scheduler.running and engine.scheduler.num_waiting == 4):  # a0 running, a1..a4 queued
            await asyncio.sleep(0.005)
        light = asyncio.create_task(one("b", "b", 3))
        while engine.scheduler.num_waiting < 5:
            await asyncio.sleep(0.005)
        more = [asyncio.create_task(one(f"a{i}", "a", 3)) for i in range(5, 8)]  # a holds 6 places: 2 fit
        return done, await asyncio.gather(*flood, light, *more, return_exceptions=True)

    try:
        done, results = asyncio.run(go())
    finally:
        engine.scheduler.config = before
    assert done.index("b") == 1  # right after the one running when it came; first come first served: 6th
    refused = [r for r in results if isinstance(r, BaseException)]  # before any event: a 429
    assert len(refused) == 1 and isinstance(refused[0], CapacityError) and "share" in refused[0].message
    assert all(isinstance(r[-1], FinishEvent) for r in results if not isinstance(r, BaseException))
    wait_idle(engine)
