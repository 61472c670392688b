"""`edgeserve chat`: a terminal chat client that streams from the gateway.

    edgeserve chat "Hello!"          one turn
    edgeserve chat                   interactive: every line is a turn; the conversation is kept

Talks to the OpenAI-compatible endpoint with the API token from `--token` or
`$EDGESERVE_TOKEN` (`edgeserve up` prints one) and prints text as it arrives.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

__all__ = ["register"]


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("chat", help="chat with a model through the gateway, streamed")
    p.add_argument("message", nargs="?", help="one message (omit for an interactive session)")
    p.add_argument("--url", default="http://127.0.0.1:8080", help="gateway base URL")
    p.add_argument("--token", default=os.environ.get("EDGESERVE_TOKEN"), help="API token ($EDGESERVE_TOKEN)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--seed", type=int, default=None)
    p.set_defaults(func=run)


def _turn(client, args: argparse.Namespace, messages: list[dict[str, str]]) -> str | None:
    """Stream one reply to stdout; return its text, or None after printing the error."""
    body = {"model": args.model, "messages": messages, "max_tokens": args.max_tokens, "stream": True,
            "temperature": args.temperature, "stream_options": {"include_usage": True}}
    if args.seed is not None:
        body["seed"] = args.seed
    parts: list[str] = []
    with client.stream("POST", f"{args.url}/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            resp.read()
            err = resp.json().get("error", {})
            print(f"error {err.get('edgeserve_code')} ({resp.status_code}): {err.get('message')}", file=sys.stderr)
            return None
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                print(f"\nerror {chunk['error'].get('edgeserve_code')}: {chunk['error']['message']}", file=sys.stderr)
                return None
            for choice in chunk["choices"]:
                piece = choice["delta"].get("content") or ""
                parts.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
            if chunk.get("usage"):
                u = chunk["usage"]
                print(f"\n[{u['prompt_tokens']} prompt + {u['completion_tokens']} completion tokens]", file=sys.stderr)
    return "".join(parts)


def run(args: argparse.Namespace) -> int:
    import httpx

    if not args.token:
        print("edgeserve chat: no API token; pass --token or set EDGESERVE_TOKEN (edgeserve up prints one)",
              file=sys.stderr)
        return 2
    messages = [{"role": "system", "content": args.system}] if args.system else []
    with httpx.Client(headers={"authorization": f"Bearer {args.token}"}, timeout=httpx.Timeout(600, connect=5)) as c:
        if args.message is not None:
            messages.append({"role": "user", "content": args.message})
            return 0 if _turn(c, args, messages) is not None else 2
        while True:
            try:
                line = input("> ")
            except EOFError:
                return 0
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line})
            reply = _turn(c, args, messages)
            if reply is None:
                messages.pop()
            else:
                messages.append({"role": "assistant", "content": reply})
