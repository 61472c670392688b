"""MLA models served as users reach them: the real gateway (real Redis, metering) in front of real
worker apps on loopback, asked with the official `openai` client, streamed.

Two tiny random models with SmolLM2's tokenizer and chat template:
  - DeepseekV3 (the Kimi K2.x architecture: MLA + MoE) over fp8_e4m3 latent pages;
  - GlmMoeDsa (GLM-5.x: MLA + MoE + the lightning indexer, FP8 indexer keys) with `index_topk`
    below the prompt length, so every attention step really prunes keys.
Each is served by one unified worker and by a prefill/decode pair (fp8_e4m3 pools both sides and
on the wire, so the decode worker's pages hold the same bytes a unified engine would have written).
The streamed text must be the detokenised greedy tokens of an offline engine of the same
configuration given the same chat prompt, usage must be metered exactly once, and every worker's
pages must be free afterwards."""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import openai
import pytest

from backend.async_engine import AsyncEngine
from backend.decode_coordinator import DecodeCoordinator
from backend.engine import EngineConfig, LLMEngine
from backend.kv_transfer import HttpKVTransport
from backend.latent_kv_cache import LatentKVCache
from backend.sampling_params import SamplingParams
from backend.tokenizer import Tokenizer
from backend.worker import create_worker_app
from gateway.app import create_gateway_app
from tests.backend.servers import serve_in_thread
from tests.backend.test_disagg import wait_free
from tests.backend.tiny_mla_models import write_tiny_deepseek_v3
from tests.gateway.conftest import ALIAS, MODEL, gateway_config, make_account, metered, wait_metered

MESSAGES = [{"role": "user", "content": "Name three rivers."}]
MAX_TOKENS = 8
KV = "fp8_e4m3"
VOCAB = 49152  # SmolLM2's tokenizer
GLM_TOPK = 8


def _engine(model_dir: Path) -> LLMEngine:
    return LLMEngine.from_pretrained(model_dir, EngineConfig(
        dtype="float32", kv_format=KV, kv_cache_bytes=2**20, page_size=16, max_model_len=256, gemm_buckets=()))


def _with_tokenizer(path: Path, smollm2_dir: Path) -> Path:
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(smollm2_dir / name, path / name)
    return path


class Expected(NamedTuple):
    """The offline engine's answer to MESSAGES: prompt ids, greedy output ids, text, finish reason."""

    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finish_reason: str


def _offline(model_dir: Path) -> Expected:
    """MESSAGES rendered by the model's chat template, generated greedily by a plain engine (no
    worker, no gateway) of the workers' configuration."""
    tok = Tokenizer.from_model_dir(model_dir)
    prompt = tok.encode_chat(MESSAGES, add_generation_prompt=True)
    engine = _engine(model_dir)
    seq = engine.add_request(prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    while engine.has_work():
        engine.step()
    finish = "stop" if seq.finish_reason == "stop" else seq.finish_reason
    return Expected(prompt, list(seq.output_ids), tok.decode(seq.output_ids), finish)


class Served(NamedTuple):
    model_dir: Path
    expected: Expected


@pytest.fixture(scope="module")
def deepseek_v3(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Served:
    path = write_tiny_deepseek_v3(tmp_path_factory.mktemp("dsv3-chat") / "m", seed=13, vocab_size=VOCAB)
    path = _with_tokenizer(path, smollm2_dir)
    return Served(path, _offline(path))


@pytest.fixture(scope="module")
def glm_moe_dsa(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Served:
    from tests.backend.test_glm_moe_dsa import write_tiny_glm_moe_dsa

    path = write_tiny_glm_moe_dsa(tmp_path_factory.mktemp("glm5-chat") / "m", seed=13, vocab_size=VOCAB,
                                  index_topk=GLM_TOPK)
    path = _with_tokenizer(path, smollm2_dir)
    return Served(path, _offline(path))


@contextlib.contextmanager
def _unified(model_dir: Path) -> Iterator[tuple[str, list[LLMEngine]]]:
    engine = _engine(model_dir)
    with serve_in_thread(create_worker_app(AsyncEngine(engine), MODEL, role="unified")) as url:
        yield url, [engine]


@contextlib.contextmanager
def _pair(model_dir: Path) -> Iterator[tuple[str, list[LLMEngine]]]:
    """A prefill worker and a decode worker pulling the prompt's latent rows (and, for DSA, the
    indexer keys) from it over loopback HTTP; the gateway talks to the decode worker."""
    prefill, decode = _engine(model_dir), _engine(model_dir)
    with serve_in_thread(create_worker_app(AsyncEngine(prefill), MODEL, role="prefill")) as prefill_url:
        adec = AsyncEngine(decode)
        coord = DecodeCoordinator(adec, [prefill_url], HttpKVTransport(), wire_format=KV, reserve_timeout_s=1.0,
                                  transfer_timeout_s=10.0)
        with serve_in_thread(create_worker_app(adec, MODEL, role="decode", coordinator=coord)) as url:
            yield url, [prefill, decode]


def _stream_chat(gateway_url: str, token: str) -> tuple[str, list[str | None], Any]:
    """One streamed greedy chat completion with usage: (text, finish reasons seen, usage)."""
    client = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key=token, max_retries=0)
    chunks = list(client.chat.completions.create(model=ALIAS, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # really streamed
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert chunks[-1].choices == []
    return text, finishes, chunks[-1].usage


@pytest.mark.parametrize("mode", ["unified", "pair"])
@pytest.mark.parametrize("model", ["deepseek_v3", "glm_moe_dsa"])
def test_streamed_chat_equals_offline_greedy_metered_once_pages_freed(model: str, mode: str, redis_url: str,
                                                                       request: pytest.FixtureRequest) -> None:
    served: Served = request.getfixturevalue(model)
    want = served.expected
    assert len(set(want.output_ids)) > 2 and want.text.strip()  # a real answer, not one repeated token
    if model == "glm_moe_dsa":
        assert len(want.prompt_ids) > 2 * GLM_TOPK  # the indexer drops keys from the first step on
    account = make_account(redis_url)
    workers = _unified if mode == "unified" else _pair
    with workers(served.model_dir) as (worker_url, engines):
        assert all(isinstance(e.cache, LatentKVCache) and e.cache.quantised for e in engines)
        stats_before = httpx.get(f"{worker_url}/stats").json()
        app = create_gateway_app(gateway_config(served.model_dir, [worker_url], redis_url))
        with serve_in_thread(app) as gw:
            text, finishes, usage = _stream_chat(gw, account.token)
        wait_free(*engines)
        stats = httpx.get(f"{worker_url}/stats").json()
    assert text == want.text
    assert finishes == [want.finish_reason]
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(want.prompt_ids), len(want.output_ids))
    assert stats["kv_format"] == KV and stats["role"] == ("unified" if mode == "unified" else "decode")
    if mode == "pair":  # the prompt's rows came from the prefill worker
        before, after = stats_before["kv_transfer"], stats["kv_transfer"]
        assert after["transfers"] == before["transfers"] + 1
        assert after["tokens"] == before["tokens"] + len(want.prompt_ids)
    (event,) = wait_metered(redis_url, account.tenant_id, 1)
    assert (int(event["prompt_tokens"]), int(event["completion_tokens"])) == (usage.prompt_tokens,
                                                                            usage.completion_tokens)
    time.sleep(0.3)
    assert len(metered(redis_url, account.tenant_id)) == 1  # once, not once per worker of the pair
