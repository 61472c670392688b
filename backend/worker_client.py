"""Typed client of the worker API (used by the gateway, benchmarks and tests).

HTTP errors are rebuilt into the same typed errors the worker raised; a worker
that cannot be reached, or whose stream breaks before the final event, raises
`BackendUnavailable`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import httpx
import msgspec

from backend.errors import BackendUnavailable, EdgeServeError, error_from_code
from backend.protocol import ErrorEvent, Event, FinishEvent, GenerateRequest, event_decoder

__all__ = ["WorkerClient"]


class WorkerClient:
    def __init__(self, base_url: str, client: httpx.AsyncClient | None = None, timeout: float = 300.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._client = client or httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=5.0))

    async def aclose(self) -> None:
        await self._client.aclose()

    async def generate(self, request: GenerateRequest,
                       on_accept: Callable[[], None] | None = None) -> AsyncIterator[Event]:
        """Stream events; the last one is a FinishEvent or ErrorEvent.

        `on_accept` is called once the worker has admitted the request (HTTP 200),
        before its first event: a failure before that point is safe to retry elsewhere.
        """
        url = f"{self.base_url}/v1/generate"
        try:
            async with self._client.stream("POST", url, content=msgspec.json.encode(request)) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    raise _typed_error(resp)
                if on_accept is not None:
                    on_accept()
                final = None
                async for line in resp.aiter_lines():
                    if not line:
                        continue
                    ev = event_decoder.decode(line)
                    if isinstance(ev, (FinishEvent, ErrorEvent)):
                        final = ev  # yielded after the body ends, so the connection goes back to the pool
                        continue
                    yield ev
                if final is not None:
                    yield final
                else:
                    raise BackendUnavailable(f"worker {self.base_url} ended the stream without a final event")
        except httpx.HTTPError as exc:
            raise BackendUnavailable(f"worker {self.base_url} unreachable or stream broken: {exc}") from exc

    async def cancel(self, request_id: str, timeout: float = 2.0) -> bool:
        """Ask the worker to end `request_id` at its next step; False if it could not be reached."""
        try:
            resp = await self._client.post(f"{self.base_url}/v1/cancel/{request_id}", timeout=timeout)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    async def stats(self) -> dict[str, object]:
        try:
            resp = await self._client.get(f"{self.base_url}/stats")
        except httpx.HTTPError as exc:
            raise BackendUnavailable(f"worker {self.base_url} unreachable: {exc}") from exc
        return resp.json()


def _typed_error(resp: httpx.Response) -> EdgeServeError:
    try:
        err = resp.json()["error"]
        details = {k: v for k, v in err.items() if k not in ("code", "type", "message")}
        return error_from_code(int(err["code"]), str(err["message"]), **details)
    except (ValueError, KeyError, TypeError):
        return BackendUnavailable(f"worker answered HTTP {resp.status_code}: {resp.text[:200]}")
