"""Gateway Prometheus metrics (one registry per app, so test apps do not collide)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
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

    def observe_finished(self, api: str, model: str, finish_reason: str, prompt_tokens: int,
                         completion_tokens: int) -> None:
        self.finished.labels(api, model, finish_reason).inc()
        self.prompt_tokens.labels(model).inc(prompt_tokens)
        self.completion_tokens.labels(model).inc(completion_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
