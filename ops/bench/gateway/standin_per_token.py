"""The per-token stand-in worker `edgeserve bench gateway` measures proxies against: `ops.standin_worker`'s
stand-in, streaming one event per token as real workers do, so every per-token cost of a path shows.

    python -m ops.bench.gateway.standin_per_token --port P --tokens N
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import msgspec

from ops.bench.gateway.load import MODEL

if TYPE_CHECKING:
    from starlette.applications import Starlette
    from starlette.requests import Request

__all__ = ["per_token_standin_app", "main"]


class _ChatFields(msgspec.Struct):
    """What the per-token chat endpoint reads of an OpenAI request (other fields are ignored)."""

    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None


def per_token_standin_app(num_tokens: int) -> Starlette:
    """`ops.standin_worker`'s stand-in, streaming as real workers do: one NDJSON `TokenEvent` per token
    on /v1/generate (`backend/worker.py` writes one line per engine step), framed by the worker's own
    `ndjson_frames` (a request with `stream=False`, the gateway's non-streamed ones, gets its lines in
    one write, as a real worker's tokens within `FLUSH_S`), and one SSE chunk per token on
    /v1/chat/completions (what the gateway sends its clients). No pause between tokens: every
    per-token cost of the path lands in the latency. Other routes are the stand-in's."""
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    from backend.event_frames import ndjson_frames
    from backend.protocol import Event, FinishEvent, GenerateRequest, TokenEvent
    from ops.standin_worker import HELLO_WORLD, create_standin_app

    app = create_standin_app(num_tokens)
    generate_decoder, chat_decoder = msgspec.json.Decoder(GenerateRequest), msgspec.json.Decoder(_ChatFields)

    texts = list(itertools.islice(itertools.cycle(HELLO_WORLD), num_tokens))  # (id, text) per token

    async def generate(request: Request) -> Response:
        req = generate_decoder.decode(await request.body())
        arrived, n = time.perf_counter(), min(num_tokens, req.params.max_tokens)

        async def events() -> AsyncIterator[Event]:
            for token_id, _ in texts[:n]:
                yield TokenEvent([token_id], [time.perf_counter() - arrived])
            elapsed = time.perf_counter() - arrived
            yield FinishEvent("length", len(req.prompt_ids), n, ttft_s=elapsed, total_s=elapsed)

        # framed as the real worker frames them: a line per token, held together when not streamed
        return StreamingResponse(ndjson_frames(events(), req.stream), media_type="application/x-ndjson")

    async def chat(request: Request) -> Response:
        req = chat_decoder.decode(await request.body())
        n = min(num_tokens, req.max_completion_tokens or req.max_tokens or num_tokens)
        usage = {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}
        head = {"id": "chatcmpl-standin", "created": int(time.time()), "model": MODEL}
        if not req.stream:
            return Response(msgspec.json.encode({**head, "object": "chat.completion", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "".join(t for _, t in texts[:n])},
                 "finish_reason": "length", "logprobs": None}], "usage": usage}), media_type="application/json")

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
            return b"data: " + msgspec.json.encode({**head, "object": "chat.completion.chunk", "choices": choices,
                                                    **extra}) + b"\n\n"

        async def body() -> AsyncIterator[bytes]:
            for k, (_, text) in enumerate(texts[:n]):
                delta = {"role": "assistant", "content": text} if k == 0 else {"content": text}
                yield chunk([{"index": 0, "delta": delta, "finish_reason": None, "logprobs": None}])
            yield chunk([{"index": 0, "delta": {}, "finish_reason": "length", "logprobs": None}])
            if (req.stream_options or {}).get("include_usage"):
                yield chunk([], usage=usage)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream", headers={"cache-control": "no-cache"})

    app.router.routes[:0] = [Route("/v1/generate", generate, methods=["POST"]),
                             Route("/v1/chat/completions", chat, methods=["POST"])]
    return app


def main(argv: list[str] | None = None) -> int:
    """`python -m ops.bench.gateway.standin_per_token --port P --tokens N`: serve the per-token stand-in
    (the bench starts it)."""
    import uvicorn

    p = argparse.ArgumentParser(prog="python -m ops.bench.gateway.standin_per_token",
                                description=per_token_standin_app.__doc__)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tokens", type=int, default=32)
    args = p.parse_args(argv)
    uvicorn.run(per_token_standin_app(args.tokens), host="127.0.0.1", port=args.port, log_level="warning",
                access_log=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
