"""Scores and sampling through the gateway with the official `openai` client: chat logprobs,
/v1/completions (string, list and token-id prompts, echo + logprobs, max_tokens 0, streamed),
and penalties on both APIs."""

from __future__ import annotations

import math

import httpx
import openai
import pytest

from tests.gateway.conftest import MODEL, Gateway, wait_pages_free


def _client(gateway: Gateway, account_path: bool = False) -> openai.OpenAI:
    base = (f"{gateway.url}/client/v4/accounts/{gateway.account.tenant_id}/ai/v1" if account_path
            else f"{gateway.url}/v1")
    return openai.OpenAI(base_url=base, api_key=gateway.account.token, max_retries=0)


def test_chat_logprobs_and_top_logprobs_streamed_and_not(gateway: Gateway) -> None:
    client = _client(gateway)
    messages = [{"role": "user", "content": "Name a colour."}]
    done = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                          logprobs=True, top_logprobs=3)
    content = done.choices[0].logprobs.content
    assert len(content) == done.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy: the likeliest
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                 reverse=True)
    assert "".join(e.token for e in content).startswith(done.choices[0].message.content or "")
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == done.choices[0].message.content

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-5)
    assert all(len(e.top_logprobs) == 2 for e in streamed)
    wait_pages_free(gateway.worker.engine)


def test_completions_string_list_and_token_id_prompts(gateway: Gateway) -> None:
    client = _client(gateway)
    tok = gateway.worker.engine.tokenizer
    one = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0)
    assert one.object == "text_completion" and len(one.choices) == 1 and one.choices[0].finish_reason == "length"
    assert one.usage.completion_tokens == 6
    ids = tok.encode("The capital of France is")
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == one.choices[0].text
    many = client.completions.create(model=MODEL, prompt=["The capital of France is", "One, two,"], max_tokens=6,
                                     temperature=0, seed=3)
    assert [c.index for c in many.choices] == [0, 1] and many.choices[0].text == one.choices[0].text
    assert many.usage.completion_tokens == 12
    ids_many = client.completions.create(model=MODEL, prompt=[ids, tok.encode("One, two,")], max_tokens=6,
                                         temperature=0)
    assert [c.text for c in ids_many.choices] == [c.text for c in many.choices]
    text = many.choices[1].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    stopped = client.completions.create(model=MODEL, prompt="One, two,", max_tokens=6, temperature=0, stop=stop)
    assert stopped.choices[0].text == text[: text.index(stop)] and stopped.choices[0].finish_reason == "stop"
    seeded = [client.completions.create(model=MODEL, prompt="Once upon", max_tokens=8, temperature=1.0, seed=9)
              .choices[0].text for _ in range(2)]
    assert seeded[0] == seeded[1]
    wait_pages_free(gateway.worker.engine)


def test_echo_logprobs_max_tokens_0_is_lm_eval_loglikelihood(gateway: Gateway) -> None:
    client = _client(gateway, account_path=True)
    engine = gateway.worker.engine
    tok = engine.tokenizer
    context, continuation = "The quick brown fox", " jumps over the lazy dog"
    ids = tok.encode(context + continuation)
    out = client.completions.create(model=MODEL, prompt=context + continuation, max_tokens=0, echo=True,
                                    logprobs=1, temperature=0)
    choice = out.choices[0]
    assert choice.text == context + continuation and choice.finish_reason == "length"
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = engine.score_tokens(ids)  # offline scoring of the same text on the same engine
    assert lp.token_logprobs[1:] == pytest.approx(want.logprobs.tolist(), abs=1e-4)
    for i, (top, is_top1) in enumerate(zip(lp.top_logprobs[1:], want.top1.tolist())):
        assert (max(top, key=top.get) == lp.tokens[i + 1]) == is_top1  # lm-eval's is_greedy
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # the same with one generated token (lm-eval's older pattern) and as a list of token-id prompts
    gen = client.completions.create(model=MODEL, prompt=[ids, ids[:5]], max_tokens=1, echo=True, logprobs=2,
                                    temperature=0)
    assert gen.choices[0].logprobs.token_logprobs[: len(ids)] == pytest.approx(lp.token_logprobs, abs=1e-5)
    assert len(gen.choices[0].logprobs.tokens) == len(ids) + 1 and len(gen.choices[1].logprobs.tokens) == 6
    assert math.isfinite(sum(gen.choices[1].logprobs.token_logprobs[1:]))
    wait_pages_free(engine)


def test_completions_streamed(gateway: Gateway) -> None:
    client = _client(gateway)
    whole = client.completions.create(model=MODEL, prompt=["Hello there", "Count: 1, 2"], max_tokens=5,
                                      temperature=0, echo=True, logprobs=1)
    chunks = list(client.completions.create(model=MODEL, prompt=["Hello there", "Count: 1, 2"], max_tokens=5,
                                            temperature=0, echo=True, logprobs=1, stream=True,
                                            stream_options={"include_usage": True}))
    for i in range(2):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert "".join(c.text for c in mine) == whole.choices[i].text
        assert [t for c in mine if c.logprobs for t in c.logprobs.tokens] == whole.choices[i].logprobs.tokens
        assert [c.finish_reason for c in mine if c.finish_reason] == [whole.choices[i].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    wait_pages_free(gateway.worker.engine)


def test_penalties_change_output_on_both_apis(gateway: Gateway) -> None:
    client = _client(gateway)
    base = dict(model=MODEL, prompt="the the the the the the", max_tokens=16, temperature=0)
    plain = client.completions.create(**base).choices[0].text
    assert client.completions.create(**base, presence_penalty=0.0).choices[0].text == plain
    assert client.completions.create(**base, presence_penalty=2.0, frequency_penalty=2.0).choices[0].text != plain
    messages = [{"role": "user", "content": "Repeat: la la la la la la la"}]
    chat = dict(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert (client.chat.completions.create(**chat, frequency_penalty=2.0).choices[0].message.content
            != client.chat.completions.create(**chat).choices[0].message.content)
    url = f"{gateway.url}/client/v4/accounts/{gateway.account.tenant_id}/ai/run/{MODEL}"
    headers = {"authorization": f"Bearer {gateway.account.token}"}
    body = {"prompt": "Repeat: la la la la la la la", "max_tokens": 16, "temperature": 0}
    a = httpx.post(url, headers=headers, json=body).json()["result"]["response"]
    b = httpx.post(url, headers=headers, json={**body, "repetition_penalty": 2.0}).json()["result"]["response"]
    assert a != b
    with pytest.raises(openai.BadRequestError):
        client.completions.create(**base, presence_penalty=3.0)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(**{**base, "max_tokens": 2}, logprobs=21)
    wait_pages_free(gateway.worker.engine)
