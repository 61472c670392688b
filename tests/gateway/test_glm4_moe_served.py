"""A Glm4Moe model served as users run it: real `edgeserve serve` processes with FP8 KV (one unified
worker, and a prefill/decode pair) behind the gateway, real Redis. The model is a tiny random
Glm4MoeForCausalLM (two MoE layers of 8 experts) with SmolLM2's tokenizer and chat template."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import httpx
import openai
import pytest

from backend.mooncake_runtime import MooncakeUnavailable, load
from gateway.app import create_gateway_app
from ops.redis_server import free_port
from tests.backend.servers import serve_in_thread
from tests.backend.tiny_models import write_tiny_glm4_moe
from tests.gateway.conftest import ALIAS, MODEL, Gateway, gateway_config, make_account, wait_metered
from tests.gateway.test_api import auth, run_url, sse_data
from tests.ops.test_drain import ENV, TOKEN, start, stop, wait_up

def mooncake_loads() -> bool:
    try:
        load()
        return True
    except MooncakeUnavailable:
        return False


WORKER_AUTH = {"authorization": f"Bearer {TOKEN}"}
MESSAGES = [{"role": "user", "content": "Name three rivers."}]
MAX_TOKENS = 8
TRANSPORT = "mooncake" if mooncake_loads() else "http"


@pytest.fixture(scope="module")
def glm_chat_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    path = write_tiny_glm4_moe(tmp_path_factory.mktemp("glm-chat") / "m", seed=13, vocab_size=49152)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(smollm2_dir / name, path / name)
    return path


class Workers(NamedTuple):
    unified: str
    prefill: str
    decode: str


@pytest.fixture(scope="module")
def workers(glm_chat_dir: Path) -> Iterator[Workers]:
    """`edgeserve serve` three times, started together (EDGESERVE_WORKER_TOKEN set for each, as in
    tests/ops/test_drain.py), every pool FP8: the prefill worker writes the prompt's KV straight into
    the decode worker's pages over the Mooncake Transfer Engine (`--kv-transport mooncake`), or sends
    it in FP8 frames where the library cannot load."""
    assert ENV["EDGESERVE_WORKER_TOKEN"] == TOKEN
    urls = Workers(*(f"http://127.0.0.1:{free_port()}" for _ in range(3)))
    common = ["--model", str(glm_chat_dir), "--served-name", MODEL, "--kv-cache-bytes", "4M", "--max-model-len", "512",
              "--threads", "1", "--gemm-buckets", "none"]
    fp8 = ["--kv-format", "fp8_e4m3"]
    port = {name: url.rsplit(":", 1)[1] for name, url in urls._asdict().items()}
    procs: list[subprocess.Popen] = []
    try:
        procs.append(start(["serve", *common, *fp8, "--port", port["unified"]]))
        procs.append(start(["serve", *common, *fp8, "--role", "prefill", "--port", port["prefill"]]))
        procs.append(start(["serve", *common, *fp8, "--role", "decode", "--port", port["decode"],
                            "--prefill-worker", urls.prefill, "--kv-wire", "fp8_e4m3", "--kv-transport", TRANSPORT]))
        for proc, url in zip(procs, urls):
            wait_up(proc, f"{url}/health")
        yield urls
    finally:
        for proc in procs:
            stop(proc)


def _gateway(model_dir: Path, worker: str, redis_url: str):
    return serve_in_thread(create_gateway_app(gateway_config(model_dir, [worker], redis_url, worker_token=TOKEN)))


def _stats(worker: str) -> dict:
    resp = httpx.get(f"{worker}/stats", headers=WORKER_AUTH)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _both_apis(gw: Gateway) -> tuple[str, dict, str, object]:
    """A streamed OpenAI chat completion (with usage) and a Workers request, same messages, greedy:
    (OpenAI text, Workers result, OpenAI finish reason, OpenAI usage)."""
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=gw.account.token, max_retries=0)
    chunks = list(client.chat.completions.create(model=ALIAS, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    (finish,) = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    resp = httpx.post(run_url(gw), headers=auth(gw.account.token),
                      json={"messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True})
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    events = sse_data(resp.text)
    assert events[-1] == "[DONE]"
    parts = [json.loads(e) for e in events[:-1]]
    result = {"response": "".join(p["response"] for p in parts), "usage": parts[-1]["usage"]}
    return text, result, finish, usage


def test_unified_worker_with_fp8_kv_answers_both_apis_streamed_and_metered(glm_chat_dir: Path, workers: Workers,
                                                                           redis_url: str) -> None:
    stats = _stats(workers.unified)
    assert stats["kv_format"] == "fp8_e4m3" and stats["role"] == "unified"
    account = make_account(redis_url)
    with _gateway(glm_chat_dir, workers.unified, redis_url) as url:
        text, result, finish, usage = _both_apis(Gateway(url, account, None))  # type: ignore[arg-type]
    assert text and result["response"] == text  # one greedy answer through both dialects
    assert finish in ("stop", "length") and 1 <= usage.completion_tokens <= MAX_TOKENS
    assert result["usage"]["prompt_tokens"] == usage.prompt_tokens > 10  # SmolLM2's template with its system line
    assert result["usage"]["completion_tokens"] == usage.completion_tokens
    events = wait_metered(redis_url, account.tenant_id, 2)
    assert [(int(e["prompt_tokens"]), int(e["completion_tokens"])) for e in events] == \
        [(usage.prompt_tokens, usage.completion_tokens)] * 2


def test_disaggregated_pair_answers_through_the_gateway_as_the_unified_worker(glm_chat_dir: Path, workers: Workers,
                                                                               redis_url: str) -> None:
    account = make_account(redis_url)
    with _gateway(glm_chat_dir, workers.unified, redis_url) as url:
        expected = _both_apis(Gateway(url, account, None))  # type: ignore[arg-type]
    before = _stats(workers.decode)["kv_transfer"]["transfers"]
    with _gateway(glm_chat_dir, workers.decode, redis_url) as url:
        got = _both_apis(Gateway(url, account, None))  # type: ignore[arg-type]
    assert got[:3] == expected[:3]  # same greedy text, usage and finish reason
    assert (got[3].prompt_tokens, got[3].completion_tokens) == (expected[3].prompt_tokens,
                                                                expected[3].completion_tokens)
    decode = _stats(workers.decode)
    assert decode["role"] == "decode" and decode["kv_format"] == "fp8_e4m3"
    assert decode["kv_transfer"]["transfers"] == before + 2  # both requests' prompts came from the prefill worker
    assert decode["kv_transfer"]["direct"] == (decode["kv_transfer"]["transfers"] if TRANSPORT == "mooncake" else 0)
    assert _stats(workers.prefill)["kv_transfer"]["transfers"] >= 2
    assert len(wait_metered(redis_url, account.tenant_id, 4)) == 4
