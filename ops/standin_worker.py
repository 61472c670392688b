"""A stand-in worker that answers at once, with no model: a benchmark fixture for `edgeserve bench gateway`.

This is not a mock of anything users run. It exists so a benchmark can measure
what sits in front of a worker (the edgeserve gateway, LiteLLM's proxy) while the
worker itself costs next to nothing. Every request gets the same N tokens
(fewer when the request's max_tokens is lower), all at once:

    POST /v1/generate          the worker protocol (`backend.protocol`): one TokenEvent
                               with the ids, then FinishEvent(finish_reason="length")
    POST /v1/chat/completions  OpenAI-compatible, streaming or not: the text of those
                               tokens, with usage (what LiteLLM's `openai/<model>` calls)
    POST /v1/cancel/{id}, GET /health, GET /stats   trivial answers

The tokens cycle through `tokens`, pairs of (id, text); the default is SmolLM2's
" hello world" (ids 33662, 905), so the gateway detokenises them into ordinary
words and every path returns the same text. The OpenAI endpoint has no
tokenizer: its `prompt_tokens` is the number of whitespace-separated words.
Streams go out as real chunked responses, one frame per yield, as the real
worker's do.

    python -m ops.standin_worker --port 8101 --tokens 32
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from backend.errors import InvalidRequest
from backend.protocol import FinishEvent, GenerateRequest, TokenEvent, encoder

__all__ = ["create_standin_app", "HELLO_WORLD", "token_text"]

# SmolLM2's tokenizer: " hello world" -> [33662, 905]; each id decodes to one word.
HELLO_WORLD: tuple[tuple[int, str], ...] = ((33662, " hello"), (905, " world"))

NDJSON = "application/x-ndjson"


class _StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _ChatRequest(msgspec.Struct):
    """The fields of an OpenAI chat request the stand-in reads (others are ignored)."""

    model: str = "standin"
    messages: list[dict[str, Any]] = []
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stream: bool = False
    stream_options: _StreamOptions | None = None


_generate_decoder = msgspec.json.Decoder(GenerateRequest)
_chat_decoder = msgspec.json.Decoder(_ChatRequest)


def token_text(n: int, tokens: Sequence[tuple[int, str]] = HELLO_WORLD) -> tuple[list[int], str]:
    """The first `n` ids of the cycle and their text."""
    chosen = list(itertools.islice(itertools.cycle(tokens), n))
    return [i for i, _ in chosen], "".join(t for _, t in chosen)


def _prompt_words(messages: list[dict[str, Any]]) -> int:
    words = 0
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = " ".join(str(p.get("text") or "") for p in content if isinstance(p, dict))
        words += len(str(content or "").split())
    return words


def create_standin_app(num_tokens: int, tokens: Sequence[tuple[int, str]] = HELLO_WORLD) -> Starlette:
    """The stand-in's ASGI app: every request gets min(num_tokens, max_tokens) tokens of `tokens`, cycled."""
    if num_tokens < 1 or not tokens:
        raise ValueError("the stand-in needs num_tokens >= 1 and at least one (id, text) token")
    served = {"requests": 0, "tokens": 0}

    def take(max_tokens: int | None) -> tuple[list[int], str]:
        n = num_tokens if max_tokens is None else max(0, min(num_tokens, max_tokens))
        served["requests"] += 1
        served["tokens"] += n
        return token_text(n, tokens)

    async def generate(request: Request) -> Response:
        try:
            req = _generate_decoder.decode(await request.body())
        except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
            err = InvalidRequest(f"invalid generate request: {exc}")
            return JSONResponse({"error": err.to_dict()}, status_code=err.http_status)
        arrived = time.perf_counter()
        ids, _ = take(req.params.max_tokens)

        async def body() -> AsyncIterator[bytes]:
            elapsed = time.perf_counter() - arrived
            yield encoder.encode(TokenEvent(ids, [elapsed] * len(ids))) + b"\n"
            yield encoder.encode(FinishEvent("length", len(req.prompt_ids), len(ids), ttft_s=elapsed,
                                             total_s=elapsed)) + b"\n"

        return StreamingResponse(body(), media_type=NDJSON)

    async def chat_completions(request: Request) -> Response:
        try:
            req = _chat_decoder.decode(await request.body())
        except msgspec.DecodeError as exc:
            return JSONResponse({"error": {"message": str(exc), "type": "invalid_request_error"}}, 400)
        ids, text = take(req.max_completion_tokens or req.max_tokens)
        prompt = _prompt_words(req.messages)
        usage = {"prompt_tokens": prompt, "completion_tokens": len(ids), "total_tokens": prompt + len(ids)}
        head = {"id": f"chatcmpl-standin-{served['requests']}", "created": int(time.time()), "model": req.model}
        if not req.stream:
            return Response(msgspec.json.encode({
                **head, "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": "length", "logprobs": None}],
                "usage": usage}), media_type="application/json")
        include_usage = req.stream_options is not None and req.stream_options.include_usage

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
            return b"data: " + msgspec.json.encode({**head, "object": "chat.completion.chunk", "choices": choices,
                                                    **extra}) + b"\n\n"

        async def body() -> AsyncIterator[bytes]:
            yield chunk([{"index": 0, "delta": {"role": "assistant", "content": text}, "finish_reason": None,
                          "logprobs": None}])
            yield chunk([{"index": 0, "delta": {}, "finish_reason": "length", "logprobs": None}])
            if include_usage:
                yield chunk([], usage=usage)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream", headers={"cache-control": "no-cache"})

    async def cancel(request: Request) -> Response:
        return JSONResponse({"cancelled": request.path_params["request_id"]})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "role": "standin", "model": "standin"})

    async def stats(request: Request) -> Response:
        return JSONResponse({"role": "standin", "num_tokens": num_tokens, "running": 0, "waiting": 0, **served})

    return Starlette(routes=[
        Route("/v1/generate", generate, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/cancel/{request_id}", cancel, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/stats", stats, methods=["GET"]),
    ])


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    p = argparse.ArgumentParser(prog="python -m ops.standin_worker", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8101)
    p.add_argument("--tokens", type=int, default=32, help="tokens per request (N)")
    args = p.parse_args(argv)
    uvicorn.run(create_standin_app(args.tokens), host=args.host, port=args.port, log_level="warning",
                access_log=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
