"""Gateway configuration: the models it serves, where their workers are, its region, routing,
the worker token it sends, and its request-header limits.

A model whose `workers` lists URLs is served from that static list; a model with
no URLs is routed over the live worker registry in Redis (`router.py`).
"""

from __future__ import annotations

import msgspec

from gateway.regions import RegionMap
from gateway.router import LOAD_SLACK, LOAD_SLACK_SHARE, RECOMPUTE_WEIGHT

__all__ = ["ModelRoute", "GatewayConfig", "DEFAULT_ALIASES"]

# Workers AI catalogue names of the models we ship, by local model name.
DEFAULT_ALIASES: dict[str, list[str]] = {
    "smollm2-135m": ["@cf/huggingface/smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"],
}


class ModelRoute(msgspec.Struct, frozen=True):
    """One served model: its name (what workers call it), aliases clients may use,
    the local model folder (tokenizer and chat template) and its workers."""

    name: str
    model_dir: str
    workers: list[str] = []  # static worker URLs; empty: route over the registry
    aliases: list[str] = []
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    tool_parser: str | None = None  # gateway/tool_parsers name; default: from the model's config.json
    reasoning_parser: str | None = None  # gateway/reasoning_parsers name or "none"; default: from config.json


class GatewayConfig(msgspec.Struct, frozen=True):
    models: list[ModelRoute]
    redis_url: str
    region: str = "local"
    keepalive_s: float = 10.0  # SSE comment interval while a request waits for tokens
    worker_timeout_s: float = 300.0  # longest silence tolerated from a worker mid-stream
    max_request_bytes: int = 4 * 2**20
    tenant_cache_s: float = 1.0  # where Redis cannot track keys: reuse a tenant's record (quotas) this long
    routing_policy: str = "prefix"  # "prefix" | "least-loaded" | "round-robin"
    routing_load_slack: int = LOAD_SLACK  # prefix policy: load differences (requests) it ignores...
    routing_load_slack_share: float = LOAD_SLACK_SHARE  # ... or this share of the least loaded worker's load
    routing_recompute_weight: float = RECOMPUTE_WEIGHT  # prefix policy: a computed prompt token against a queued one
    regions: RegionMap = RegionMap()
    max_waiting_per_worker: int = 16  # a worker with this many waiting counts as saturated
    # append-only file of usage Redis could not take yet (replayed when it returns); None: the first free
    # $EDGESERVE_HOME/journal/gateway-<n>.jsonl (gateway/usage_journal.py)
    usage_journal_path: str | None = None
    # 0: usage records that end while a metering write is in flight share the next one (group commit);
    # > 0: each waits up to this long for others (gateway/metering.py)
    usage_flush_s: float = 0.0
    worker_token: str | None = None  # sent to workers as a Bearer token; keep it out of logs
    max_header_bytes: int = 32 * 2**10  # request headers (names + values) past this: 431
    max_headers: int = 100
