"""Clients for the workers the router picks: one aiohttp session (one connection pool) for all
of them, created in the serving loop on first use, and one `WorkerClient` per worker URL."""

from __future__ import annotations

import aiohttp

from backend.worker_client import WorkerClient, worker_session

__all__ = ["WorkerPool"]


class WorkerPool:
    def __init__(self, timeout_s: float = 300.0) -> None:
        self._timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._clients: dict[str, WorkerClient] = {}

    def client(self, url: str) -> WorkerClient:
        if self._session is None:
            self._session = worker_session(self._timeout_s)
        client = self._clients.get(url)
        if client is None:
            client = self._clients[url] = WorkerClient(url, self._session)
        return client

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
