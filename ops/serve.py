"""`edgeserve serve` (one worker) and `edgeserve up` (the local cluster).

Until the gateway exists, `up` pulls the default model and runs one unified
worker on it, printing how to call it.
"""

from __future__ import annotations

import argparse
import logging
import os
import re

__all__ = ["register", "DEFAULT_MODEL", "parse_bytes"]

DEFAULT_MODEL = "smollm2-135m"
log = logging.getLogger(__name__)


def parse_bytes(text: str) -> int:
    """'256M', '2G', '1048576' -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]?)(?:i?b)?\s*", text.lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 512M, 2G)")
    return int(float(match.group(1)) * {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}[match.group(2)])


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="model name to pull, or a Hugging Face-format folder")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="compute dtype (float32 is the fast one on CPUs without BF16 units)")
    p.add_argument("--kv-format", default="fp32", choices=["fp32", "bf16", "fp8_e4m3"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--kv-cache-bytes", type=parse_bytes, default=parse_bytes("512M"))
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--prefill-chunk-size", type=int, default=256)
    p.add_argument("--max-waiting", type=int, default=256)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")


def register(subparsers: argparse._SubParsersAction) -> None:
    serve = subparsers.add_parser("serve", help="run one worker (role unified)")
    _add_engine_args(serve)
    serve.add_argument("--role", default="unified", choices=["unified"])
    serve.set_defaults(func=run_serve)
    up = subparsers.add_parser("up", help="pull the default model and run the local cluster")
    _add_engine_args(up)
    up.set_defaults(func=run_up, role="unified")


def run_serve(args: argparse.Namespace, banner: bool = False) -> int:
    import uvicorn

    from backend.async_engine import AsyncEngine
    from backend.engine import EngineConfig, LLMEngine
    from backend.worker import create_worker_app
    from ops.pull import resolve_model

    model_dir = resolve_model(args.model)
    config = EngineConfig(dtype=args.dtype, kv_format=args.kv_format, kv_cache_bytes=args.kv_cache_bytes,
                          page_size=args.page_size, max_model_len=args.max_model_len,
                          max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          prefill_chunk_size=args.prefill_chunk_size, max_waiting=args.max_waiting,
                          num_threads=args.threads, device=args.device)
    engine = LLMEngine.from_pretrained(model_dir, config)
    app = create_worker_app(AsyncEngine(engine), model_name=args.model, role=args.role)
    snap = engine.snapshot()
    print(f"edgeserve worker ({args.role}) serving {args.model} from {model_dir}\n"
          f"  KV pool: {snap['pages_total']} pages x {snap['page_size']} tokens ({snap['kv_format']}, "
          f"{snap['kv_bytes_per_token']} B/token), context {snap['max_model_len']}", flush=True)
    if banner:
        base = f"http://{args.host}:{args.port}"
        print(f"""
  Try it (token ids in, token ids out, one JSON event per line):
    edgeserve chat --url {base} "Write a haiku about the sea"
    curl -sN {base}/v1/generate -d '{{"prompt_ids": [1, 9690, 198], "params": {{"max_tokens": 16}}}}'
    curl -s {base}/stats
""", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0


def run_up(args: argparse.Namespace) -> int:
    from ops.pull import resolve_model

    if not os.path.isdir(args.model):
        resolve_model(args.model)  # pull first, with progress, before loading anything
    return run_serve(args, banner=True)
