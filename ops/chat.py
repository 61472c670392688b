"""`edgeserve chat`: a terminal chat client that streams from the gateway.

    edgeserve chat "Hello!"          one turn
    edgeserve chat                   interactive: every line is a turn; the conversation is kept

Interactive commands: ``/reset`` starts the conversation over, ``/quit`` (or
``quit``, ``exit``, Ctrl-D) ends the session; none of them reaches the model. Ctrl-C
stops the reply being streamed (the gateway cancels it) and the session goes on.

Gateway, token and model come from the flags, else the environment
(`$EDGESERVE_URL`, `$EDGESERVE_TOKEN`), else the running `edgeserve up`'s record
(its gateway, the demo tenant's token, its model; `ops.cluster_record`), else the
built-in defaults. Text goes to stdout as it arrives; token counts and errors to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import httpx

__all__ = ["register", "run", "DEFAULT_URL", "QUIT_WORDS", "RESET_WORDS"]

DEFAULT_URL = "http://127.0.0.1:8080"
QUIT_WORDS = frozenset({"/quit", "/exit", "quit", "exit"})
RESET_WORDS = frozenset({"/reset"})
DESCRIPTION = """\
Chat with a model through the gateway; replies stream as they are written.

  edgeserve chat "Hello!"      one turn
  edgeserve chat               a conversation: /reset starts over, /quit or Ctrl-D ends it,
                               Ctrl-C stops a reply

With no flags it talks to the cluster `edgeserve up` runs, with that cluster's demo token."""
BANNER = "Chatting with {model} at {url}. /reset starts over, /quit or Ctrl-D ends, Ctrl-C stops a reply."


def register(subparsers: argparse._SubParsersAction) -> None:
    from ops.serve import DEFAULT_MODEL

    p = subparsers.add_parser("chat", help="chat with a model through the gateway, streamed",
                              description=DESCRIPTION)
    p.add_argument("message", nargs="?", help="one message (omit for an interactive session)")
    p.add_argument("--url", default=None,
                   help=f"gateway base URL (default: $EDGESERVE_URL, else the running `edgeserve up`'s, else "
                        f"{DEFAULT_URL})")
    p.add_argument("--token", default=None,
                   help="API token (default: $EDGESERVE_TOKEN, else the running `edgeserve up`'s demo token)")
    p.add_argument("--model", default=None,
                   help=f"model name (default: the running `edgeserve up`'s, else {DEFAULT_MODEL})")
    p.add_argument("--system", default=None, help="system prompt (default: none)")
    p.add_argument("--max-tokens", type=int, default=256, help="longest reply, in tokens")
    p.add_argument("--temperature", type=float, default=0.6, help="sampling temperature")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    p.set_defaults(func=run)


def _resolve(args: argparse.Namespace) -> None:
    """Fill --url, --token and --model: flag, environment, the running cluster's record, default."""
    from ops.cluster_record import setting
    from ops.serve import DEFAULT_MODEL

    args.url = setting(args.url, "EDGESERVE_URL", "gateway_url", DEFAULT_URL).rstrip("/")
    args.token = setting(args.token, "EDGESERVE_TOKEN", "token", None)
    args.model = setting(args.model, None, "model", DEFAULT_MODEL)


def _refusal(resp: httpx.Response) -> str:
    """One line for a non-200 answer: the gateway's error object, or the start of whatever else answered."""
    resp.read()
    try:
        err = resp.json()["error"]
        return f"error {err.get('edgeserve_code')} ({resp.status_code}): {err.get('message')}"
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"error ({resp.status_code}) from {resp.request.url}: {' '.join(resp.text.split())[:200]}"


def _turn(client: httpx.Client, args: argparse.Namespace, messages: list[dict[str, str]]) -> str | None:
    """Stream one reply to stdout; return its text (what arrived before a Ctrl-C, too), or None when
    there is no reply (an error, printed, or a Ctrl-C before it began). A reply always ends with a newline."""
    body = {"model": args.model, "messages": messages, "max_tokens": args.max_tokens, "stream": True,
            "temperature": args.temperature, "stream_options": {"include_usage": True}}
    if args.seed is not None:
        body["seed"] = args.seed
    parts: list[str] | None = None  # a list once the reply has started
    note = ""  # said on stderr after the reply's line ends: token counts, or that it was stopped
    try:
        with client.stream("POST", f"{args.url}/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                print(_refusal(resp), file=sys.stderr)
                return None
            parts = []
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    note = f"error {chunk['error'].get('edgeserve_code')}: {chunk['error']['message']}"
                    return None
                for choice in chunk["choices"]:
                    piece = choice["delta"].get("content") or ""
                    parts.append(piece)
                    sys.stdout.write(piece)
                    sys.stdout.flush()
                if chunk.get("usage"):
                    u = chunk["usage"]
                    note = f"[{u['prompt_tokens']} prompt + {u['completion_tokens']} completion tokens]"
    except KeyboardInterrupt:  # closing the stream (leaving the `with`) makes the gateway cancel the request
        note = "[stopped]"
    finally:
        if parts is not None:
            sys.stdout.write("\n")
            sys.stdout.flush()
        if note:
            print(note, file=sys.stderr, flush=True)
    return None if parts is None else "".join(parts)


def _session(client: httpx.Client, args: argparse.Namespace, messages: list[dict[str, str]]) -> int:
    """The interactive loop: a turn per line until /quit or end of input."""
    start = list(messages)  # the system prompt, kept by /reset
    client.get(f"{args.url}/healthz")  # a gateway that is not there is said now, not after the first line typed
    print(BANNER.format(model=args.model, url=args.url), file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:  # at the prompt: a fresh line, as a shell does
            print("\n(/quit or Ctrl-D ends the session)", file=sys.stderr)
            continue
        if not line:
            continue
        if line.lower() in QUIT_WORDS:
            return 0
        if line.lower() in RESET_WORDS:
            messages[:] = start
            print("(conversation cleared)", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": line})
        reply = _turn(client, args, messages)
        if reply is None:
            messages.pop()
        else:
            messages.append({"role": "assistant", "content": reply})


def run(args: argparse.Namespace) -> int:
    """Send the one message, or run the interactive session."""
    import httpx

    from ops.hints import start_hint

    _resolve(args)
    if not args.token:
        print(f"edgeserve chat: no API token and no running cluster; {start_hint()}, or pass --token "
              f"(or set EDGESERVE_TOKEN)", file=sys.stderr)
        return 2
    messages = [{"role": "system", "content": args.system}] if args.system else []
    with httpx.Client(headers={"authorization": f"Bearer {args.token}"}, timeout=httpx.Timeout(600, connect=5)) as c:
        if args.message is not None:
            messages.append({"role": "user", "content": args.message})
            return 0 if _turn(c, args, messages) is not None else 2
        return _session(c, args, messages)
