"""`edgeserve bench gateway`'s per-token stand-in streams as real workers do (one NDJSON event per
token, read back by the gateway's own worker client; one SSE chunk per token on its OpenAI
endpoint), and the bench's comparison reports p95 beside p50 and p99."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import msgspec
import pytest

from backend.protocol import FinishEvent, GenerateRequest, TokenEvent
from backend.sampling_params import SamplingParams
from backend.worker_client import WorkerClient
from ops.bench.gateway.load import Row, worker_body
from ops.bench.gateway.report import compare
from ops.bench.gateway.standin_per_token import per_token_standin_app
from ops.standin_worker import token_text
from tests.backend.servers import serve_in_thread


def test_generate_sends_one_token_event_per_token_then_the_finish() -> None:
    async def go() -> tuple[list, list]:
        with serve_in_thread(per_token_standin_app(7)) as url:
            client = WorkerClient(url)
            full = [ev async for ev in client.generate(GenerateRequest([1, 2, 3], SamplingParams(max_tokens=50)))]
            capped = [ev async for ev in client.generate(GenerateRequest([4], SamplingParams(max_tokens=3)))]
            await client.aclose()
        return full, capped

    full, capped = asyncio.run(go())
    ids, _ = token_text(7)
    assert [type(ev) for ev in full] == [TokenEvent] * 7 + [FinishEvent]
    assert [ev.token_ids for ev in full[:-1]] == [[i] for i in ids]
    assert all(len(ev.times) == 1 for ev in full[:-1])
    assert (full[-1].finish_reason, full[-1].prompt_tokens, full[-1].completion_tokens) == ("length", 3, 7)
    assert [ev.token_ids for ev in capped[:-1]] == [[i] for i in ids[:3]] and capped[-1].completion_tokens == 3


def test_the_worker_rows_request_is_a_non_streamed_one_and_gets_its_tokens_together(smollm2_dir: Path) -> None:
    # the gateway asks `stream=False` for a non-streamed chat; the `worker` row must measure that same leg
    body = worker_body(7)
    req = msgspec.json.decode(body, type=GenerateRequest)
    assert req.stream is False and req.params.max_tokens == 7 and req.prompt_ids

    async def go() -> list:
        with serve_in_thread(per_token_standin_app(7)) as url:
            client = WorkerClient(url)
            events = [ev async for ev in client.generate(req)]
            await client.aclose()
        return events

    events = asyncio.run(go())
    ids, _ = token_text(7)
    assert [type(ev) for ev in events] == [TokenEvent, FinishEvent]  # the lines held, the tokens joined
    assert events[0].token_ids == list(ids) and events[1].completion_tokens == 7


def test_openai_stream_sends_one_chunk_per_token() -> None:
    async def go() -> tuple[list[str], dict]:
        transport = httpx.ASGITransport(per_token_standin_app(5))
        async with httpx.AsyncClient(transport=transport, base_url="http://standin") as http:
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True,
                    "stream_options": {"include_usage": True}}
            stream = await http.post("/v1/chat/completions", content=msgspec.json.encode(body))
            plain = await http.post("/v1/chat/completions", json={"messages": []})
        return [e[len("data: "):] for e in stream.text.split("\n\n") if e], plain.json()

    events, plain = asyncio.run(go())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["delta"].get("content") for c in chunks[:4]] == [" hello", " world", " hello", " world"]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant" and "role" not in chunks[1]["choices"][0]["delta"]
    assert chunks[4]["choices"][0]["finish_reason"] == "length" and chunks[5]["usage"]["completion_tokens"] == 4
    assert plain["choices"][0]["message"]["content"] == token_text(5)[1]


def test_compare_reports_added_p95() -> None:
    def row(target: str, p50: float, p95: float | None, p99: float) -> Row:
        return Row(target=target, concurrency=1, stream=True, requests=10, errors=0, seconds=1.0, rps=10.0,
                   p50_ms=p50, p99_ms=p99, p95_ms=p95, p50_rounds_ms=[p50], rps_rounds=[10.0])

    cmp = compare([row("direct", 1.0, 2.0, 4.0), row("edgeserve+quota", 2.5, 5.5, 9.0), row("old", 3.0, None, 9.0)])
    quota = cmp["edgeserve+quota"]["c1_stream"]
    assert (quota["added_p50_ms"], quota["added_p95_ms"], quota["added_p99_ms"]) == pytest.approx((1.5, 3.5, 5.0))
    assert cmp["old"]["c1_stream"]["added_p95_ms"] is None  # a row without p95 has none to subtract
