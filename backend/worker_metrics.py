"""Prometheus metrics of one worker, read from the engine at scrape time.

A custom collector (no background thread, nothing to keep in sync): every
scrape reads `LLMEngine.snapshot()` (values the engine thread published, safe
from the scrape's thread) and reports pool occupancy, the active KV format's
bytes per token, load and counters.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from backend.engine import LLMEngine

__all__ = ["worker_registry", "render_metrics", "CONTENT_TYPE"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_GAUGES = {
    "running": ("edgeserve_requests_running", "Requests in the running batch"),
    "waiting": ("edgeserve_requests_waiting", "Requests in the wait queue"),
    "pages_total": ("edgeserve_kv_pages_total", "KV pages in the pool"),
    "pages_used": ("edgeserve_kv_pages_used", "KV pages held by requests"),
    "pages_free": ("edgeserve_kv_pages_free", "KV pages free"),
    "kv_bytes_per_token": ("edgeserve_kv_bytes_per_token", "Pool bytes per token of the active KV format"),
}
_COUNTERS = {
    "steps": ("edgeserve_engine_steps", "Engine steps run"),
    "prompt_tokens": ("edgeserve_prompt_tokens", "Prompt tokens prefilled"),
    "generated_tokens": ("edgeserve_generated_tokens", "Tokens generated"),
    "finished": ("edgeserve_requests_finished", "Requests finished normally"),
    "cancelled": ("edgeserve_requests_cancelled", "Requests cancelled"),
    "failed": ("edgeserve_requests_failed", "Requests ended by a failed step"),
    "integrity_checks": ("edgeserve_kv_integrity_checks", "Batched KV page-tag checks run"),
    "kv_events_dropped": ("edgeserve_kv_events_dropped",
                          "Prefix-cache KV events dropped unpublished (the in-process list was full)"),
}


class _EngineCollector(Collector):
    def __init__(self, engine: LLMEngine, model: str, role: str) -> None:
        self.engine, self.labels = engine, {"model": model, "role": role}

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        snap = self.engine.snapshot()
        names, values = list(self.labels), list(self.labels.values())
        for key, (name, doc) in _GAUGES.items():
            labels = names + (["kv_format"] if key == "kv_bytes_per_token" else [])
            extra = [str(snap["kv_format"])] if key == "kv_bytes_per_token" else []
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values + extra, float(snap[key]))  # type: ignore[arg-type]
            yield g
        for key, (name, doc) in _COUNTERS.items():
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, float(snap[key]))  # type: ignore[arg-type]
            yield c
        aborts = CounterMetricFamily("edgeserve_kv_integrity_aborts", "Requests aborted by the KV integrity check",
                                     labels=[*names, "cause"])
        for cause, n in snap["integrity_aborts_by_cause"].items():  # type: ignore[union-attr]
            aborts.add_metric([*values, cause], float(n))
        yield aborts


def worker_registry(engine: LLMEngine, model: str, role: str) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=True)
    registry.register(_EngineCollector(engine, model, role))
    return registry


def render_metrics(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
