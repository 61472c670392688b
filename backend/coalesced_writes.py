"""Writes of one event-loop turn sent together: one `send` where uvicorn makes several.

uvicorn writes a response's status line and headers the moment the app sends
`http.response.start`, then the body on `http.response.body`: two `send` syscalls and
two TCP segments for every non-streamed answer, and a chunked stream's last event and its
`0\\r\\n\\r\\n` end likewise. On loopback a send also runs the receiver's TCP input in the
sender's syscall, so each costs tens of microseconds of the server's CPU, and the receiver
wakes and reads twice. `CoalescingTransport` wraps the connection's transport (the servers'
protocol does it in `connection_made`, `backend/http_limits.py`): a write is held and
scheduled to leave with `loop.call_soon`, so everything written before the writing task
next yields (a head and its body, events handed over together) leaves in one write. The
hold lasts until the current callbacks have run, never a timer; `close` and `write_eof`
send what is held first, `abort` drops it as the transport's own would. Flow control is
the wrapped transport's: held bytes are counted in `get_write_buffer_size`.
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["CoalescingTransport"]


class CoalescingTransport:
    """`transport` (an asyncio write transport) with its writes of one loop turn joined (module docstring);
    every other attribute is the wrapped transport's."""

    __slots__ = ("_transport", "_loop", "_held")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._transport = transport
        self._loop = loop or asyncio.get_running_loop()
        self._held: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Hold `data` until the loop's next turn (or `close`); an empty write does nothing, as asyncio's."""
        if not data:
            return
        if not self._held:
            self._loop.call_soon(self._flush)
        self._held.append(bytes(data) if not isinstance(data, bytes) else data)

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:
            self.write(data)

    def _flush(self) -> None:
        held, self._held = self._held, []
        if held and not self._transport.is_closing():
            self._transport.write(held[0] if len(held) == 1 else b"".join(held))

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def write_eof(self) -> None:
        self._flush()
        self._transport.write_eof()

    def abort(self) -> None:
        self._held = []
        self._transport.abort()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(len(d) for d in self._held)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)
