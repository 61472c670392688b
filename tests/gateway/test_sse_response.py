"""`SSEResponse` runs its `after` (the generation's close and metering wait) exactly once however the
response ends: sent whole, or the server's `send` failing before the first byte (body never started)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from gateway.sse import SSEResponse

SCOPE = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "method": "GET", "path": "/"}


@pytest.mark.parametrize("send_fails", [False, True])
def test_after_runs_once_whether_or_not_the_response_went_out(send_fails: bool) -> None:
    calls: list[str] = []

    async def body() -> AsyncIterator[bytes]:
        calls.append("body")
        yield b"data: 1\n\n"

    async def after() -> None:
        calls.append("after")

    async def receive() -> dict:
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    sent: list[dict] = []

    async def send(message: dict) -> None:
        if send_fails:
            raise OSError("the client is gone")
        sent.append(message)

    async def run() -> None:
        await SSEResponse(body(), {}, after=after)(SCOPE, receive, send)

    if send_fails:
        with pytest.raises(OSError):
            asyncio.run(run())
        assert calls == ["after"]
    else:
        asyncio.run(run())
        assert calls == ["body", "after"]
        assert [m["type"] for m in sent] == ["http.response.start", "http.response.body", "http.response.body"]
