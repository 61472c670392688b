"""`edgeserve bench gateway` pieces: the stand-in worker's two APIs and the added-latency arithmetic."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import msgspec
import pytest

from backend.protocol import FinishEvent, GenerateRequest, TokenEvent, event_decoder
from backend.sampling_params import SamplingParams
from backend.tokenizer import Tokenizer
from backend.worker_client import WorkerClient
from tests.backend.servers import serve_in_thread
from ops.bench.gateway.load import Row
from ops.bench.gateway.passthrough import passthrough_app
from ops.bench.gateway.report import compare, over_floor, target_verdicts, vs_baseline
from ops.standin_worker import HELLO_WORLD, create_standin_app, token_text


def _client(num_tokens: int) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(create_standin_app(num_tokens)), base_url="http://standin")


def test_standin_speaks_the_worker_protocol() -> None:
    async def go() -> tuple[list, list, list]:
        async with _client(7) as http:
            raw = await http.post("/v1/generate", content=msgspec.json.encode(
                GenerateRequest([1, 2, 3], SamplingParams(max_tokens=50))))
            lines = [event_decoder.decode(line) for line in raw.content.splitlines() if line]
            with serve_in_thread(create_standin_app(7)) as url:  # the gateway's own client reads it too
                client = WorkerClient(url)
                capped = [ev async for ev in client.generate(GenerateRequest([4, 5], SamplingParams(max_tokens=3)))]
                await client.aclose()
            bad = await http.post("/v1/generate", content=b'{"prompt_ids": "no"}')
            return lines, capped, [bad.status_code, bad.json()["error"]["code"]]

    lines, capped, bad = asyncio.run(go())
    ids, _ = token_text(7)
    assert [type(ev) for ev in lines] == [TokenEvent, FinishEvent]
    assert lines[0].token_ids == ids == [33662, 905] * 3 + [33662] and len(lines[0].times) == 7
    assert (lines[1].finish_reason, lines[1].prompt_tokens, lines[1].completion_tokens) == ("length", 3, 7)
    assert [type(ev) for ev in capped] == [TokenEvent, FinishEvent]
    assert capped[0].token_ids == ids[:3]  # max_tokens below N caps the reply
    assert (capped[1].prompt_tokens, capped[1].completion_tokens) == (2, 3)
    assert bad == [400, 3000]


def test_standin_openai_returns_the_text_of_its_tokens(smollm2_dir: Path) -> None:
    tok = Tokenizer.from_model_dir(smollm2_dir)
    assert [tok.decode([i]) for i, _ in HELLO_WORLD] == [text for _, text in HELLO_WORLD]
    ids, text = token_text(5)
    assert text == tok.decode(ids) == " hello world hello world hello"
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "say hello to me"}]}

    async def go() -> tuple[dict, dict, list[str]]:
        async with _client(5) as http:
            plain = (await http.post("/v1/chat/completions", json=body)).json()
            capped = (await http.post("/v1/chat/completions", json={**body, "max_tokens": 2})).json()
            stream = await http.post("/v1/chat/completions", json={**body, "stream": True,
                                                                   "stream_options": {"include_usage": True}})
            assert stream.headers["content-type"].startswith("text/event-stream")
            return plain, capped, [e[len("data: "):] for e in stream.text.split("\n\n") if e]

    plain, capped, events = asyncio.run(go())
    assert plain["choices"][0]["message"] == {"role": "assistant", "content": text}
    assert plain["choices"][0]["finish_reason"] == "length"
    assert plain["usage"] == {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9}
    assert capped["choices"][0]["message"]["content"] == " hello world"
    assert capped["usage"]["completion_tokens"] == 2
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == text
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]] == [None, "length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5


def _row(target: str, c: int, stream: bool, p50: float, p99: float, rps: float, rounds: list[float]) -> Row:
    return Row(target=target, concurrency=c, stream=stream, requests=100, errors=0, seconds=1.0, rps=rps,
               p50_ms=p50, p99_ms=p99, p50_rounds_ms=rounds, rps_rounds=[rps])


def test_compare_subtracts_direct_and_divides_by_litellm_per_setting() -> None:
    rows = [
        _row("direct", 1, False, 1.0, 3.0, 1000.0, [1.0, 1.5]),
        _row("edgeserve", 1, False, 2.5, 4.0, 600.0, [2.0, 3.0]),
        _row("litellm", 1, False, 6.0, 20.0, 200.0, [6.0, 6.0]),
        # another setting with different numbers: mixing up keys would show
        _row("direct", 16, True, 10.0, 30.0, 1600.0, [10.0]),
        _row("edgeserve", 16, True, 12.0, 50.0, 800.0, [13.0]),
        _row("litellm", 16, True, 40.0, 90.0, 400.0, [41.0]),
    ]
    cmp = compare(rows)
    e1, e16 = cmp["edgeserve"]["c1_nostream"], cmp["edgeserve"]["c16_stream"]
    assert e1["added_p50_ms"] == pytest.approx(1.5) and e1["added_p99_ms"] == pytest.approx(1.0)
    assert e1["added_p50_rounds_ms"] == pytest.approx((1.0, 1.5))
    assert e1["rps_ratio_vs_litellm"] == pytest.approx(3.0)
    assert e16["added_p50_ms"] == pytest.approx(2.0) and e16["added_p99_ms"] == pytest.approx(20.0)
    assert e16["rps_ratio_vs_litellm"] == pytest.approx(2.0)
    l1 = cmp["litellm"]["c1_nostream"]
    assert (l1["added_p50_ms"], l1["added_p99_ms"], l1["rps_ratio_vs_litellm"]) == pytest.approx((5.0, 17.0, 1.0))
    d1 = cmp["direct"]["c1_nostream"]
    assert d1["added_p50_ms"] is None and d1["rps_ratio_vs_litellm"] == pytest.approx(5.0)
    assert cmp["direct"]["c16_stream"]["rps_ratio_vs_litellm"] == pytest.approx(4.0)

    without = compare([r for r in rows if r.target != "litellm"])
    assert "litellm" not in without
    assert without["edgeserve"]["c1_nostream"]["rps_ratio_vs_litellm"] is None
    assert without["edgeserve"]["c1_nostream"]["added_p50_ms"] == pytest.approx(1.5)


def test_vs_baseline_pairs_the_two_gateways_round_by_round() -> None:
    def row(target: str, p50s: list[float], cpus: list[float], stream: bool = False) -> Row:
        return Row(target=target, concurrency=1, stream=stream, requests=100, errors=0, seconds=1.0, rps=100.0,
                   p50_ms=sorted(p50s)[len(p50s) // 2], p99_ms=9.0, p50_rounds_ms=p50s, rps_rounds=[100.0],
                   proxy_cpu_ms_per_request=sum(cpus) / len(cpus) if cpus else None, cpu_rounds_ms=cpus)

    # the machine slows down over the run (rounds 3-4 twice as slow for both gateways): paired, this tree
    # is 0.8x the baseline every round, which the pooled medians blur
    rows = [row("direct", [1.0, 1.0, 2.0, 2.0], []),
            row("edgeserve", [2.0, 2.4, 4.0, 4.8], [1.6, 1.6, 3.2, 3.2]),
            row("edgeserve@abc", [2.5, 3.0, 5.0, 6.0], [2.0, 2.0, 4.0, 4.0]),
            row("edgeserve+quota", [3.0, 3.0, 6.0, 6.0], [2.0, 2.0, 4.0, 4.0]),
            row("edgeserve+quota@abc", [3.0, 2.0, 6.0, 4.0], [2.0, 2.0, 2.0, 2.0])]
    vs = vs_baseline(rows, compare(rows), "abc")
    plain, quota = vs["edgeserve"]["c1_nostream"], vs["edgeserve+quota"]["c1_nostream"]
    assert plain["p50_round_ratio"] == pytest.approx({"median": 0.8, "min": 0.8, "max": 0.8, "rounds": 4})
    assert plain["cpu_round_ratio"] == pytest.approx({"median": 0.8, "min": 0.8, "max": 0.8, "rounds": 4})
    assert quota["p50_round_ratio"] == pytest.approx({"median": 1.25, "min": 1.0, "max": 1.5, "rounds": 4})
    assert quota["cpu_round_ratio"] == pytest.approx({"median": 1.5, "min": 1.0, "max": 2.0, "rounds": 4})
    assert vs_baseline([r for r in rows if "@" not in r.target], compare(rows[:2]), "abc")[
        "edgeserve"]["c1_nostream"]["p50_round_ratio"] is None


def test_targets_judge_every_round_for_the_quota_tenant() -> None:
    def row(target: str, key: tuple[int, bool], p50s: list[float], rps: list[float]) -> Row:
        return Row(target=target, concurrency=key[0], stream=key[1], requests=100, errors=0, seconds=1.0,
                   rps=sum(rps) / len(rps), p50_ms=p50s[0], p99_ms=9.0, p50_rounds_ms=p50s, rps_rounds=rps)

    nostream, stream, c16 = (1, False), (1, True), (16, False)
    rows = [row("direct", nostream, [1.0, 1.2, 1.1], [900, 800, 850]),
            row("edgeserve+quota", nostream, [2.9, 3.4, 3.0], [300, 280, 290]),  # +1.9, +2.2, +1.9: one round over
            row("edgeserve", nostream, [2.0, 2.0, 2.0], [400, 400, 400]),  # no quotas: not judged
            row("litellm", nostream, [9.0, 9.0, 9.0], [50, 50, 50]),
            row("direct", stream, [2.0, 2.0, 2.0], [500, 500, 500]),
            row("edgeserve+quota", stream, [3.5, 3.9, 3.0], [200, 200, 200]),  # every round within 2 ms
            row("litellm", stream, [9.0, 9.0, 9.0], [50, 300, 50]),  # one round faster than edgeserve
            row("direct", c16, [5.0, 5.0, 5.0], [900, 900, 900]),
            row("edgeserve+quota", c16, [9.0, 9.0, 9.0], [10, 20, 30]),  # slower than LiteLLM every round
            row("litellm", c16, [20.0, 20.0, 20.0], [40, 40, 40])]
    got = target_verdicts(rows)
    assert got["added_p50_le_2ms_c1_nostream"]["verdict"] == "unresolved"
    assert got["added_p50_le_2ms_c1_nostream"]["per_round"] == pytest.approx([1.9, 2.2, 1.9])
    assert got["added_p50_le_2ms_c1_stream"]["verdict"] == "met" and got["added_p50_le_2ms_c1_stream"]["met"]
    assert got["rps_gt_litellm_c1_nostream"]["verdict"] == "met"
    assert got["rps_gt_litellm_c1_stream"]["verdict"] == "unresolved"
    assert got["rps_gt_litellm_c16_nostream"]["verdict"] == "missed" and not got["rps_gt_litellm_c16_nostream"]["met"]
    assert set(got) == {"added_p50_le_2ms_c1_nostream", "added_p50_le_2ms_c1_stream", "rps_gt_litellm_c1_nostream",
                        "rps_gt_litellm_c1_stream", "rps_gt_litellm_c16_nostream"}
    # without LiteLLM only the latency targets remain; a slow gateway misses them
    slow = [r for r in rows if r.target != "litellm"]
    slow[1] = row("edgeserve+quota", nostream, [4.0, 4.0, 4.0], [300, 300, 300])
    assert {k: v["verdict"] for k, v in target_verdicts(slow).items()} == {
        "added_p50_le_2ms_c1_nostream": "missed", "added_p50_le_2ms_c1_stream": "met"}


def _answer(body: bytes) -> list[dict]:
    """A chat answer's JSON objects (one, or the stream's events) less what differs per call (`id`, `created`)."""
    events = [e for e in body.decode().replace("data: ", "").split("\n\n") if e.strip() and e != "[DONE]"]
    return [{k: v for k, v in json.loads(e).items() if k not in ("id", "created")} for e in events]


def test_passthrough_relays_the_answer_both_ways() -> None:
    """The framework floor's proxy returns the stand-in's own bytes: whole when not streamed, the same events
    when streamed (so the two targets answer alike and only the path differs)."""
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

    def fetch(url: str, stream: bool) -> tuple[int, str, bytes]:
        resp = httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": stream}, timeout=10)
        return resp.status_code, resp.headers["content-type"].split(";")[0], resp.content

    with serve_in_thread(create_standin_app(6)) as standin, serve_in_thread(passthrough_app(standin)) as proxy:
        for stream in (False, True):
            direct, relayed = fetch(standin, stream), fetch(proxy, stream)
            assert relayed[:2] == direct[:2] == (200, "text/event-stream" if stream else "application/json")
            assert _answer(relayed[2]) == _answer(direct[2])
            assert len(_answer(direct[2])) > 1 if stream else len(_answer(direct[2])) == 1
            assert relayed[2].endswith(b"data: [DONE]\n\n") if stream else relayed[2].startswith(b"{")
        bad = httpx.post(f"{proxy}/v1/chat/completions", content=b"{", timeout=10)
        assert bad.status_code == httpx.post(f"{standin}/v1/chat/completions", content=b"{").status_code == 400


def test_over_floor_subtracts_the_passthrough_per_setting_and_round() -> None:
    rows = [_row("direct", 1, False, 1.0, 3.0, 900.0, [1.0, 2.0]),
            _row("passthrough", 1, False, 2.0, 4.0, 500.0, [1.8, 3.4]),
            _row("edgeserve+quota", 1, False, 3.5, 6.0, 300.0, [3.0, 5.0]),
            _row("litellm", 1, False, 9.0, 20.0, 50.0, [9.0, 9.0]),  # not an edgeserve target: left out
            _row("direct", 1, True, 2.0, 4.0, 400.0, [2.0]),  # no pass-through at this setting: no entry
            _row("edgeserve+quota", 1, True, 4.0, 6.0, 200.0, [4.0])]
    got = over_floor(rows)
    assert set(got) == {"c1_nostream"}
    e = got["c1_nostream"]
    assert e["floor_added_p50_ms"] == pytest.approx(1.0)
    assert e["above_floor_p50_ms"] == pytest.approx({"edgeserve+quota": 1.5})
    assert e["above_floor_rounds_ms"]["edgeserve+quota"] == pytest.approx((1.2, 1.6))
