"""`edgeserve chat`: one chat turn against a running worker, streamed to the terminal.

Applies the model's chat template and tokenises locally, sends token ids, and
prints the reply as it is detokenised (the job the gateway will do).
"""

from __future__ import annotations

import argparse
import asyncio
import sys

__all__ = ["register"]


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("chat", help="send one chat message to a running worker")
    p.add_argument("message")
    p.add_argument("--url", default="http://127.0.0.1:8100")
    p.add_argument("--model", default="smollm2-135m", help="model name or folder (for its tokenizer)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--seed", type=int, default=None)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from backend.protocol import ErrorEvent, FinishEvent, GenerateRequest, TokenEvent
    from backend.sampling_params import SamplingParams
    from backend.tokenizer import IncrementalDetokenizer, Tokenizer
    from backend.worker_client import WorkerClient
    from ops.pull import resolve_model

    tok = Tokenizer.from_model_dir(resolve_model(args.model))
    prompt = tok.apply_chat_template([{"role": "user", "content": args.message}], add_generation_prompt=True)
    ids = tok.encode(prompt)
    req = GenerateRequest(prompt_ids=ids, params=SamplingParams(max_tokens=args.max_tokens,
                                                                temperature=args.temperature, seed=args.seed))

    async def go() -> int:
        client = WorkerClient(args.url)
        detok = IncrementalDetokenizer(tok)
        try:
            async for ev in client.generate(req):
                if isinstance(ev, TokenEvent):
                    for t in ev.token_ids:
                        sys.stdout.write(detok.push(t))
                    sys.stdout.flush()
                elif isinstance(ev, FinishEvent):
                    sys.stdout.write(detok.flush() + "\n")
                    print(f"[{ev.finish_reason}: {ev.prompt_tokens} prompt + {ev.completion_tokens} completion "
                          f"tokens, TTFT {ev.ttft_s or 0:.3f}s, total {ev.total_s:.2f}s]", file=sys.stderr)
                elif isinstance(ev, ErrorEvent):
                    print(f"\nerror {ev.code} ({ev.type}): {ev.message}", file=sys.stderr)
                    return 2
        finally:
            await client.aclose()
        return 0

    return asyncio.run(go())
