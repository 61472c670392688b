"""`CoalescingTransport` over a real loopback connection: what one loop turn writes leaves in one write of
the wrapped transport, in order; `close` sends what is held, `abort` drops it. A counting wrapper between
the two records the writes that reach the real transport."""

from __future__ import annotations

import asyncio
import os
import random

import pytest
from uvicorn.config import Config
from uvicorn.server import ServerState

from backend.coalesced_writes import CoalescingTransport
from backend.http_limits import HeaderLimits, guarded_http_protocol


class _Counted:
    """Forwards to a real transport, recording each write that reaches it."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport, self.writes = transport, []

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))
        self.transport.write(data)

    def __getattr__(self, name: str):
        return getattr(self.transport, name)


async def _pair() -> tuple[_Counted, asyncio.StreamReader, asyncio.StreamWriter, asyncio.AbstractServer]:
    """A real TCP connection on loopback: the server side's transport (counted), the client's reader and writer
    (hold on to it: a collected writer closes the client's end), the server."""
    accepted: asyncio.Future[asyncio.Transport] = asyncio.get_running_loop().create_future()

    class Server(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            accepted.set_result(transport)

    server = await asyncio.get_running_loop().create_server(Server, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    return _Counted(await accepted), reader, writer, server


def _chunks(rng: random.Random, n: int) -> list[bytes]:
    return [os.urandom(rng.randint(1, 3000)) for _ in range(n)]


def test_one_turn_leaves_in_one_write_and_turns_stay_in_order():
    async def run() -> None:
        rng = random.Random()
        counted, reader, _client, server = await _pair()
        t = CoalescingTransport(counted)
        turns = [_chunks(rng, rng.randint(1, 5)) for _ in range(4)]
        for chunks in turns:
            t.write(chunks[0])
            t.writelines(chunks[1:])
            t.write(b"")  # nothing, as asyncio's transports
            assert t.get_write_buffer_size() >= sum(map(len, chunks))
            await asyncio.sleep(0)  # the writing task yields: the turn's bytes leave
        assert counted.writes == [b"".join(c) for c in turns]  # one write per turn, each turn's bytes in order
        everything = b"".join(b"".join(c) for c in turns)
        assert await reader.readexactly(len(everything)) == everything
        t.close()
        server.close()

    asyncio.run(run())


def test_close_sends_what_is_held_and_abort_drops_it():
    async def run() -> None:
        counted, reader, _client, server = await _pair()
        t = CoalescingTransport(counted)
        data = os.urandom(5000)
        t.write(data[:10])
        t.write(bytearray(data[10:]))  # a mutable buffer is copied when held
        t.close()  # before the loop turns: held bytes go first, then the end of the stream
        assert await reader.read() == data
        assert counted.writes == [data]

        counted, reader, _client2, server2 = await _pair()
        t = CoalescingTransport(counted)
        t.write(b"never sent")
        t.abort()
        await asyncio.sleep(0)
        assert counted.writes == []
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            await reader.readexactly(1)
        server.close()
        server2.close()

    asyncio.run(run())


def test_the_servers_protocol_wraps_its_transport():
    """The protocol `ops/graceful.py` serves with (gateway and workers) writes through a CoalescingTransport."""
    async def run() -> None:
        protocol_class = guarded_http_protocol(HeaderLimits(), render=lambda *a: None)

        async def app(scope, receive, send) -> None:  # never called: the test writes to the transport itself
            raise AssertionError("no request was sent")

        config = Config(app=app, http=protocol_class, lifespan="off", log_level="warning")
        config.load()

        counted, reader, _client, server = await _pair()
        protocol = protocol_class(config=config, server_state=ServerState(), app_state={})
        protocol.connection_made(counted)
        assert isinstance(protocol.transport, CoalescingTransport)
        protocol.transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
        protocol.transport.write(b"ok")
        await asyncio.sleep(0)
        assert counted.writes == [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"]
        protocol.transport.close()
        server.close()

    asyncio.run(run())
