"""Which worker runs a request (static list per model, round-robin) until routing lands.

`candidates(model)` gives every worker of the model, starting with the next one
in turn; the generation tries the second only if the first failed before
accepting the request (nothing has reached the client yet). All worker clients
share one aiohttp session (one connection pool), created in the serving loop.
"""

from __future__ import annotations

import itertools

import aiohttp

from backend.worker_client import WorkerClient, worker_session
from gateway.served_models import ServedModel

__all__ = ["WorkerPool"]


class WorkerPool:
    def __init__(self, models: list[ServedModel], timeout_s: float = 300.0) -> None:
        self._timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._urls = {m.name: list(m.route.workers) for m in models}
        self._clients: dict[str, WorkerClient] = {}
        self._turn = {m.name: itertools.count() for m in models}

    def candidates(self, model: ServedModel) -> list[WorkerClient]:
        if self._session is None:
            self._session = worker_session(self._timeout_s)
            self._clients = {u: WorkerClient(u, self._session) for urls in self._urls.values() for u in urls}
        urls = self._urls[model.name]
        start = next(self._turn[model.name]) % len(urls)
        return [self._clients[u] for u in urls[start:] + urls[:start]]

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
