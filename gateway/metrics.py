"""Gateway Prometheus metrics (one registry per app, so test apps do not collide).

Every request touches five series; each is looked up once per label set and kept
(`prometheus_client`'s `labels()` costs ~6 µs a call, which the gateway paid five times
per request).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["GatewayMetrics", "CONTENT_TYPE_LATEST"]


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("edgeserve_gateway_requests", "Requests answered, by API and outcome code",
                                ["api", "code"], registry=self.registry)
        self.finished = Counter("edgeserve_gateway_generations", "Generations that reached a worker, by end",
                                ["api", "model", "finish_reason"], registry=self.registry)
        self.prompt_tokens = Counter("edgeserve_gateway_prompt_tokens", "Prompt tokens sent to workers",
                                     ["model"], registry=self.registry)
        self.completion_tokens = Counter("edgeserve_gateway_completion_tokens", "Completion tokens streamed",
                                         ["model"], registry=self.registry)
        self.ttft = Histogram("edgeserve_gateway_ttft_seconds", "Arrival at the gateway to first token",
                              ["api"], registry=self.registry,
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))

        self._series: dict[tuple[object, ...], Any] = {}

    def _child(self, metric: Counter | Histogram, *labels: str) -> Any:
        key = (id(metric), *labels)
        child = self._series.get(key)
        if child is None:
            child = self._series[key] = metric.labels(*labels)
        return child

    def count_request(self, api: str, code: int | str) -> None:
        """One request answered by `api` with outcome `code` ("200", or a typed error's code)."""
        self._child(self.requests, api, str(code)).inc()

    def observe_ttft(self, api: str, seconds: float) -> None:
        self._child(self.ttft, api).observe(seconds)

    def observe_finished(self, api: str, model: str, finish_reason: str, prompt_tokens: int,
                         completion_tokens: int) -> None:
        self._child(self.finished, api, model, finish_reason).inc()
        self._child(self.prompt_tokens, model).inc(prompt_tokens)
        self._child(self.completion_tokens, model).inc(completion_tokens)

    def watch_piece_caches(self, caches: dict[str, Any]) -> None:
        """`edgeserve_gateway_prompt_pieces_total{model, result}`: prompt pieces each model's tokenizer took from
        its `PieceCache` (hit) or encoded (miss), read from the caches' own counters when scraped (nothing per
        request)."""
        self.registry.register(_PieceCacheCollector(caches))

    def watch_auth(self, tenants: Any) -> None:
        """`edgeserve_gateway_auth_lookups_total{result}`: tokens the tenant store answered from its tracked reads
        (held) or looked up in Redis (redis), read from its counters when scraped."""
        self.registry.register(_AuthCollector(tenants))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _PieceCacheCollector:
    def __init__(self, caches: dict[str, Any]) -> None:
        self._caches = caches

    def collect(self) -> Any:
        family = CounterMetricFamily("edgeserve_gateway_prompt_pieces", "Prompt pieces between control tokens, "
                                     "from the tokenizer's cache (hit) or encoded (miss)", labels=["model", "result"])
        for model, cache in self._caches.items():
            family.add_metric([model, "hit"], cache.hits)
            family.add_metric([model, "miss"], cache.misses)
        yield family


class _AuthCollector:
    def __init__(self, tenants: Any) -> None:
        self._tenants = tenants

    def collect(self) -> Any:
        family = CounterMetricFamily("edgeserve_gateway_auth_lookups", "API tokens authenticated from the gateway's "
                                     "tracked reads (held) or looked up in Redis (redis)", labels=["result"])
        family.add_metric(["held"], self._tenants.held_lookups)
        family.add_metric(["redis"], self._tenants.redis_lookups)
        yield family
