"""Which worker runs a request (static list per model, round-robin) until routing lands.

`candidates(model)` gives every worker of the model, starting with the next one
in turn; the generation tries the second only if the first failed before
accepting the request (nothing has reached the client yet).
"""

from __future__ import annotations

import itertools

import httpx

from backend.worker_client import WorkerClient
from gateway.served_models import ServedModel

__all__ = ["WorkerPool"]


class WorkerPool:
    def __init__(self, models: list[ServedModel], timeout_s: float = 300.0) -> None:
        # One connection pool for all workers; generous limits so concurrency is not capped here.
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0),
                                       limits=httpx.Limits(max_connections=4096, max_keepalive_connections=512))
        self._clients = {url: WorkerClient(url, self._http) for m in models for url in m.route.workers}
        self._turn = {m.name: itertools.count() for m in models}

    def candidates(self, model: ServedModel) -> list[WorkerClient]:
        urls = model.route.workers
        start = next(self._turn[model.name]) % len(urls)
        return [self._clients[u] for u in urls[start:] + urls[:start]]

    async def aclose(self) -> None:
        await self._http.aclose()
