"""`edgeserve gateway`: run one gateway replica in front of running workers.

Replicas are stateless: run as many as you like against the same Redis. The
gateway sends the worker token (`--worker-token` or `$EDGESERVE_WORKER_TOKEN`) on
every worker call. SIGTERM or Ctrl-C drains it: new requests get 503 Draining, open
streams finish for up to `--drain-timeout` seconds, the rest end with an in-stream
Draining error; then it exits 0.
"""

from __future__ import annotations

import argparse
import os

from ops.serve import add_drain_arg

__all__ = ["register", "build_config", "DEFAULT_REDIS_URL"]

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("gateway", help="run a gateway replica (workers and Redis must be running)")
    p.add_argument("--model", default="smollm2-135m", help="model name or folder (its tokenizer and template)")
    p.add_argument("--served-name", default=None, help="the name workers serve it under (default: --model)")
    p.add_argument("--worker", action="append", default=[],
                   help="a static worker URL (repeat for several; default: none, route over the Redis registry)")
    p.add_argument("--policy", default="prefix", choices=["prefix", "least-loaded", "round-robin"],
                   help="how to pick among a region's workers")
    p.add_argument("--load-slack", type=int, default=None, metavar="N",
                   help="prefix policy: a worker's load beyond the least loaded's, in requests, that costs nothing "
                        "against its cached prefix (default 2) ...")
    p.add_argument("--load-slack-share", type=float, default=None, metavar="F",
                   help="... or this share of the least loaded worker's load, when more (default 0.5; both 0: "
                        "every request weighs)")
    p.add_argument("--recompute-weight", type=float, default=None, metavar="K",
                   help="prefix policy: what a prompt token a worker must compute costs against one queued ahead "
                        "of the request there (default 2: a conversation waits on the worker caching it at most as "
                        "long as recomputing its prefix elsewhere would take; 1: the fastest start for each request)")
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL", DEFAULT_REDIS_URL),
                   help="Redis with tenants, keys, usage and the worker registry ($REDIS_URL when set)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8080, help="port to listen on")
    p.add_argument("--region", default="local", help="this gateway's region: it prefers workers in the same one")
    p.add_argument("--trust-region-headers", action="store_true",
                   help="route by the client's x-edgeserve-region / cf-ipcountry headers; only behind an edge that "
                        "sets them itself and strips what clients send (default: off, the gateway's own region)")
    p.add_argument("--usage-journal", default=None, metavar="PATH",
                   help="file for usage Redis could not take yet, replayed when it returns (default: the first "
                        "free $EDGESERVE_HOME/journal/gateway-<n>.jsonl)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt plus reply the gateway admits (default: the model's context length)")
    p.add_argument("--keepalive", type=float, default=10.0, help="seconds between SSE keep-alive comments")
    p.add_argument("--worker-token", default=None,
                   help="the workers' shared token (default: $EDGESERVE_WORKER_TOKEN; the environment keeps it "
                        "out of `ps`)")
    p.add_argument("--tool-parser", default=None, choices=["hermes", "glm45", "kimi_k2"],
                   help="how to read tool calls in the model's output (default: from its config.json; hermes)")
    p.add_argument("--reasoning-parser", default=None, choices=["deepseek_r1", "qwen3", "glm45", "kimi_k2", "none"],
                   help="split <think> reasoning into reasoning_content (default: from its config.json where the "
                        "family is certain: qwen3, glm4_moe, kimi_k2; else off)")
    add_drain_arg(p)
    p.set_defaults(func=run)


def build_config(model: str, workers: list[str], redis_url: str, *, served_name: str | None = None,
                 region: str = "local", max_model_len: int | None = None, keepalive_s: float = 10.0,
                 policy: str = "prefix", trust_region_headers: bool = False, worker_token: str | None = None,
                 usage_journal: str | None = None, tool_parser: str | None = None,
                 reasoning_parser: str | None = None, load_slack: int | None = None,
                 load_slack_share: float | None = None, recompute_weight: float | None = None):
    """GatewayConfig for one model (pulled if it is a known name) served by `workers`."""
    from gateway.config import DEFAULT_ALIASES, GatewayConfig, ModelRoute
    from gateway.regions import RegionMap
    from ops.pull import resolve_model

    name = served_name or model
    route = ModelRoute(name=name, model_dir=str(resolve_model(model)), workers=workers,
                       aliases=DEFAULT_ALIASES.get(name, []), max_model_len=max_model_len,
                       tool_parser=tool_parser, reasoning_parser=reasoning_parser)
    routing = {k: v for k, v in (("routing_load_slack", load_slack), ("routing_load_slack_share", load_slack_share),
                                 ("routing_recompute_weight", recompute_weight)) if v is not None}  # unset: defaults
    return GatewayConfig(models=[route], redis_url=redis_url, region=region, keepalive_s=keepalive_s,
                         routing_policy=policy, **routing,
                         regions=RegionMap(trust_headers=trust_region_headers),
                         worker_token=worker_token, usage_journal_path=usage_journal)


def run(args: argparse.Namespace) -> int:
    from backend.worker_auth import resolve_token
    from backend.redis_client import redact
    from gateway.app import create_gateway_app, render_error
    from ops.graceful import serve

    token = resolve_token(args.worker_token)
    config = build_config(args.model, args.worker, args.redis_url, served_name=args.served_name,
                          region=args.region, max_model_len=args.max_model_len, keepalive_s=args.keepalive,
                          policy=args.policy, trust_region_headers=args.trust_region_headers, worker_token=token,
                          usage_journal=args.usage_journal, tool_parser=args.tool_parser,
                          reasoning_parser=args.reasoning_parser, load_slack=args.load_slack,
                          load_slack_share=args.load_slack_share, recompute_weight=args.recompute_weight)
    where = ", ".join(args.worker) if args.worker else f"the worker registry in {redact(args.redis_url)}"
    print(f"edgeserve gateway on http://{args.host}:{args.port} -> {where}"
          f"{'' if token else ' (no worker token)'}", flush=True)
    app = create_gateway_app(config)
    serve(app, args.host, args.port, drain_timeout_s=args.drain_timeout, render=render_error)
    return 0
