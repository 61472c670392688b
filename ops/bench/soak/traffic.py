"""The soak test's clients: tenants' mixed traffic through the gateways, malformed requests, worker probes.

Every request becomes one `RequestResult` (`ops.bench.soak.checks`), filled in as the
client saw it. A client stream is read as SSE: OpenAI chunks (``delta.content``,
a final ``usage`` chunk as ``stream_options.include_usage`` asks, ``[DONE]``, or
``data: {"error": ...}``) and Workers events (``{"response": ...}``, a last one with
``usage``, ``[DONE]``, or ``event: error`` with the envelope).

A *leave* is a client that goes away on purpose: a stream after its first few
content events (``disconnected``: the request id is known), a non-streamed request
before its response (``abandoned``: whether it was admitted is unknown).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ops.bench.soak.checks import RequestResult, classify_response, classify_stream_error

if TYPE_CHECKING:
    import httpx

__all__ = ["RequestSpec", "Tenant", "send", "traffic_spec", "malformed_specs", "worker_generate",
           "send_cut_body", "PROMPTS", "MODEL", "TENANTS"]

MODEL = "smollm2-135m"
# name -> (requests per minute, tokens per day, clients, leaves non-streamed requests)
TENANTS: dict[str, tuple[int | None, int | None, int, bool]] = {
    "steady": (None, None, 2, False),
    "leaver": (None, None, 1, True),
    "rpm-limited": (6, None, 1, False),
    "token-limited": (None, 1500, 1, False),
    "malformed": (None, None, 0, False),
    "probe": (None, None, 0, False),
}
PROMPTS = ("Say hello to the world.", "Name three colours.", "What is two plus two?",
           "Write one sentence about the sea.", "List the days of the week.", "Why is the sky blue?",
           "Give me a word that rhymes with cat.", "Describe a tree in five words.")


@dataclass(frozen=True)
class Tenant:
    name: str
    id: str
    token: str
    leaves_non_stream: bool = False  # its clients sometimes abandon non-streamed requests


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: where, what, and whether (and when) its client leaves."""

    tenant: str
    api: str  # "openai" | "workers" | "malformed"
    url: str
    headers: dict[str, str]
    body: bytes
    stream: bool
    leave_after_events: int | None = None  # stream: leave after this many content events
    leave_after_s: float | None = None  # non-stream: leave if no response by then
    label: str = ""  # what a malformed request gets wrong


def _auth(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}", "content-type": "application/json"}


def traffic_spec(rng: random.Random, tenant: Tenant, gateway: str, system: str) -> RequestSpec:
    """A random well-formed request of `tenant`: either API, streamed or not, 8-24 tokens, maybe a leave."""
    stream, api, max_tokens = rng.random() < 0.5, rng.choice(("openai", "workers")), rng.randint(8, 24)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": rng.choice(PROMPTS)}]
    if api == "openai":
        url = f"{gateway}/v1/chat/completions"
        body: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "stream": stream,
                                "temperature": 0.7, "seed": rng.randrange(2**31)}
        if stream:
            body["stream_options"] = {"include_usage": True}
    else:
        url = f"{gateway}/client/v4/accounts/{tenant.id}/ai/run/{MODEL}"
        body = {"max_tokens": max_tokens, "stream": stream, "seed": rng.randrange(2**31)}
        if rng.random() < 0.5:
            body["messages"] = messages
        else:
            body["prompt"] = rng.choice(PROMPTS)
    leave_events = rng.randint(1, 3) if stream and rng.random() < 0.15 else None
    leave_s = rng.uniform(0.1, 1.5) if not stream and tenant.leaves_non_stream and rng.random() < 0.3 else None
    return RequestSpec(tenant.name, api, url, _auth(tenant.token), json.dumps(body).encode(), stream,
                       leave_events, leave_s)


def malformed_specs(tenant: Tenant, other: Tenant, gateway: str) -> list[RequestSpec]:
    """One of each kind of malformed request (all small; none should ever be a 5xx)."""
    chat = f"{gateway}/v1/chat/completions"
    run = f"{gateway}/client/v4/accounts/{tenant.id}/ai/run/{MODEL}"
    ok_chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    nested = "[" * 1000 + "]" * 1000
    auth = _auth(tenant.token)
    cases: list[tuple[str, str, str, dict[str, str], bytes]] = [
        ("invalid JSON", "openai", chat, auth, b'{"model": "smollm2-135m", "messages": ['),
        ("wrong types", "openai", chat, auth,
         json.dumps({"model": MODEL, "messages": "hi", "max_tokens": "x"}).encode()),
        ("1000-deep JSON in an unknown field", "openai", chat, auth,
         json.dumps(ok_chat).encode()[:-1] + b', "extra": ' + nested.encode() + b"}"),
        ("1000-deep JSON in tools", "openai", chat, auth,
         json.dumps(ok_chat).encode()[:-1] + b', "tools": [' + nested.encode() + b"]}"),
        ("1000-deep JSON (Workers)", "workers", run, auth,
         b'{"prompt": "hi", "max_tokens": 4, "response_format": ' + nested.encode() + b"}"),
        ("no API key", "openai", chat, {"content-type": "application/json"}, json.dumps(ok_chat).encode()),
        ("unknown API key", "openai", chat, _auth("es_" + "x" * 43), json.dumps(ok_chat).encode()),
        ("unknown model", "openai", chat, auth, json.dumps({**ok_chat, "model": "no-such-model"}).encode()),
        ("max_tokens 0", "openai", chat, auth, json.dumps({**ok_chat, "max_tokens": 0}).encode()),
        ("empty prompt", "workers", run, auth, b'{"prompt": ""}'),
        ("prompt and messages", "workers", run, auth,
         json.dumps({"prompt": "a", "messages": ok_chat["messages"]}).encode()),
        ("another tenant's account", "workers", f"{gateway}/client/v4/accounts/{other.id}/ai/run/{MODEL}", auth,
         b'{"prompt": "hi", "max_tokens": 4}'),
        ("unsupported n > 1", "openai", chat, auth, json.dumps({**ok_chat, "n": 2}).encode()),
        ("64 KB header", "openai", chat, {**auth, "x-junk": "a" * 65536}, json.dumps(ok_chat).encode()),
    ]
    return [RequestSpec(tenant.name, "malformed", url, headers, body, False, label=label)
            for label, _api, url, headers, body in cases]


async def send(client: httpx.AsyncClient, spec: RequestSpec, t0: float, timeout_s: float) -> RequestResult:
    """Send `spec` and classify what came back; never raises (a transport failure is an outcome)."""
    import httpx

    res = RequestResult(spec.tenant, spec.api, spec.stream, sent=time.perf_counter() - t0)
    try:
        await asyncio.wait_for(_exchange(client, spec, res), timeout_s)
    except TimeoutError:
        res.outcome, res.detail = "timeout", f"no end within {timeout_s:.0f} s"
    except httpx.ConnectError as exc:
        res.outcome, res.detail = "connect_error", repr(exc)[:200]
    except (httpx.HTTPError, ValueError) as exc:  # the connection broke, or the server sent garbage
        if res.outcome not in ("disconnected", "abandoned"):
            res.outcome, res.detail = "untyped_5xx", f"broken response: {exc!r}"[:200]
    res.ended = time.perf_counter() - t0
    return res


async def _exchange(client: httpx.AsyncClient, spec: RequestSpec, res: RequestResult) -> None:
    request = client.build_request("POST", spec.url, content=spec.body, headers=spec.headers)
    if spec.leave_after_s is not None:
        try:
            resp = await asyncio.wait_for(client.send(request, stream=True), spec.leave_after_s)
        except TimeoutError:
            res.outcome = "abandoned"
            return
    else:
        resp = await client.send(request, stream=True)
    try:
        res.status = resp.status_code
        res.request_id = resp.headers.get("x-edgeserve-request-id") or None
        res.route = resp.headers.get("x-edgeserve-route", "")
        if resp.status_code != 200 or not spec.stream:
            body = await resp.aread()
            res.outcome, res.error_code = classify_response(resp.status_code, resp.headers, body)
            if resp.status_code == 200:
                res.delivered_tokens = _body_completion_tokens(body)
            else:
                res.detail = (f"{spec.label}: " if spec.label else "") + body[:200].decode(errors="replace")
            return
        await _read_stream(resp, spec, res)
    finally:
        await resp.aclose()


def _body_completion_tokens(body: bytes) -> int:
    with_usage = json.loads(body)
    usage = with_usage.get("usage") or (with_usage.get("result") or {}).get("usage") or {}
    return int(usage.get("completion_tokens", 0))


async def _read_stream(resp: httpx.Response, spec: RequestSpec, res: RequestResult) -> None:
    """Read SSE until [DONE], an error event, or the client's planned leave."""
    content_events, usage_tokens, event_name, done = 0, None, None, False
    async for line in resp.aiter_lines():
        if line.startswith("event:"):
            event_name = line[6:].strip()
            continue
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            break
        payload = json.loads(data)
        if event_name == "error" or "error" in payload or payload.get("success") is False:
            res.outcome, res.error_code = classify_stream_error(payload)
            res.delivered_tokens, res.detail = content_events, data[:200]
            return
        event_name = None
        if payload.get("usage"):
            usage_tokens = int(payload["usage"].get("completion_tokens", 0))
        piece = (payload.get("choices") or [{}])[0].get("delta", {}).get("content") if spec.api == "openai" \
            else payload.get("response")
        if piece:
            content_events += 1
            if spec.leave_after_events is not None and content_events >= spec.leave_after_events:
                res.outcome, res.delivered_tokens = "disconnected", content_events
                return
    if done and usage_tokens is not None:
        res.outcome, res.delivered_tokens = "ok", usage_tokens
    else:
        res.outcome, res.delivered_tokens = "untyped_5xx", content_events
        res.detail = "stream ended without [DONE] and usage, and without an error event"


async def send_cut_body(gateway: str, token: str, t0: float, tenant: str) -> RequestResult:
    """A client that announces a 1000-byte body, sends 20 bytes and hangs up (no response expected)."""
    host, port = gateway.removeprefix("http://").split(":")
    res = RequestResult(tenant, "malformed", False, sent=time.perf_counter() - t0, outcome="disconnected",
                        detail="body cut off mid-read")
    try:
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write((f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\nauthorization: Bearer {token}\r\n"
                      f"content-type: application/json\r\ncontent-length: 1000\r\n\r\n").encode() + b'{"model": "smol')
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.close()
        await writer.wait_closed()
    except OSError as exc:
        res.outcome, res.detail = "connect_error", repr(exc)[:200]
    res.ended = time.perf_counter() - t0
    return res


async def worker_generate(client: httpx.AsyncClient, worker: str, prompt_ids: list[int], max_tokens: int,
                          request_id: str, headers: dict[str, str],
                          on_line: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any] | None:
    """One request straight to a worker's `/v1/generate`; its last event (finish or error), None if the
    stream broke without one. HTTP errors come back as {"event": "http_error", "status", "body"}."""
    body = {"prompt_ids": prompt_ids, "params": {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True},
            "request_id": request_id}
    last = None
    async with client.stream("POST", f"{worker}/v1/generate", json=body, headers=headers) as resp:
        if resp.status_code != 200:
            return {"event": "http_error", "status": resp.status_code,
                    "body": (await resp.aread())[:200].decode(errors="replace")}
        async for line in resp.aiter_lines():
            if line.strip():
                last = json.loads(line)
                if on_line is not None:
                    on_line(last)
    return last if last is not None and last.get("event") in ("finish", "error") else None
