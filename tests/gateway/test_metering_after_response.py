"""Metering outlives the response: a request whose usage is still on its way to Redis when the
client has its answer (and the response side closes the generation) is metered all the same."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from gateway.app import create_gateway_app
from tests.backend.servers import serve_in_thread
from tests.gateway.conftest import MODEL, gateway_config, make_account, metered, wait_metered
from tests.gateway.test_api import auth


@pytest.mark.parametrize("stream", [False, True])
def test_slow_metering_is_not_cancelled_when_the_response_ends(worker, tiny_chat_dir, redis_url: str,
                                                               stream: bool) -> None:
    app = create_gateway_app(gateway_config(tiny_chat_dir, [worker.url], redis_url))
    meter = app.state.gateway.meter
    record = meter.record

    async def slow_record(*args, **kwargs):  # Redis answering slowly: the response is long gone by then
        await asyncio.sleep(0.5)
        return await record(*args, **kwargs)

    meter.record = slow_record
    account = make_account(redis_url)
    with serve_in_thread(app) as url:
        for i in range(3):
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 4,
                    "stream": stream}
            resp = httpx.post(f"{url}/v1/chat/completions", headers=auth(account.token), json=body, timeout=30)
            assert resp.status_code == 200, resp.text
        events = wait_metered(redis_url, account.tenant_id, 3)
    assert len(metered(redis_url, account.tenant_id)) == 3
    assert {e["finish_reason"] for e in events} <= {"stop", "length"}
    assert all(int(e["completion_tokens"]) >= 1 for e in events)
