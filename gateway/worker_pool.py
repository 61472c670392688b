"""Clients for the workers the router picks: one aiohttp session (one connection pool) for all
of them, created in the serving loop on first use, and one `WorkerClient` per worker URL, each
sending the worker token when one is configured. A draining gateway ends every open worker
stream at once with `end_streams`."""

from __future__ import annotations

import aiohttp

from backend.errors import EdgeServeError
from backend.worker_client import WorkerClient, worker_session

__all__ = ["WorkerPool"]


class WorkerPool:
    def __init__(self, timeout_s: float = 300.0, token: str | None = None) -> None:
        self._timeout_s = timeout_s
        self._token = token
        self._session: aiohttp.ClientSession | None = None
        self._clients: dict[str, WorkerClient] = {}

    def client(self, url: str) -> WorkerClient:
        if self._session is None:
            self._session = worker_session(self._timeout_s)
        client = self._clients.get(url)
        if client is None:
            client = self._clients[url] = WorkerClient(url, self._session, token=self._token)
        return client

    def end_streams(self, err: EdgeServeError) -> int:
        """End every open worker stream with `err` (each request's final event); returns how many."""
        return sum(client.end_streams(err) for client in self._clients.values())

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
