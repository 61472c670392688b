"""A generate request's events → the NDJSON body the worker writes: one frame per token, or held together.

A streamed request (`GenerateRequest.stream`, the default) gets every event on its
own line, written the moment it exists: the gateway forwards each token to its
client as it comes.

A request whose client takes the answer whole (the gateway's non-streamed chat,
completions and Workers-style calls set `stream=False`) needs no token before the
end, yet one write per token costs both sides per token: a chunk, a syscall and an
event-loop wake-up at the worker, and a read, a parse and a task switch at the
gateway. Such a request's events are written in frames of at most `flush_s`
seconds: each event is held until `flush_s` has passed since the last write, then
everything held leaves in one write; the final event (finish or error) leaves at
once with whatever is held. The body is the same NDJSON either way (a reader parses
lines; it never sees frame edges), so only the number of writes changes.

Why not hold everything to the end: the gateway's per-read timeout would then bound
the length of a non-streamed generation, and a worker writes to a connection only
when it has something to say, so a client that left is noticed at the next write
(within `flush_s`, besides the gateway's explicit cancel). Tokens held at the
worker when it dies never reach the gateway and are not metered, as for any
token that did not arrive.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from backend.protocol import ErrorEvent, Event, FinishEvent, encoder

__all__ = ["FLUSH_S", "ndjson_frames"]

FLUSH_S = 0.25  # longest time an event of a non-streamed request is held before it is written


async def ndjson_frames(events: AsyncIterator[Event], stream: bool = True,
                        flush_s: float = FLUSH_S) -> AsyncIterator[bytes]:
    """The NDJSON body of `events`: a line per frame when `stream`, else lines held up to `flush_s` (module doc)."""
    if stream:
        async for ev in events:
            yield encoder.encode(ev) + b"\n"
        return
    held: list[bytes] = []
    last_write = time.monotonic()
    async for ev in events:
        held.append(encoder.encode(ev))
        now = time.monotonic()
        if isinstance(ev, (FinishEvent, ErrorEvent)) or now - last_write >= flush_s:
            held.append(b"")
            yield b"\n".join(held)
            held.clear()
            last_write = now
    if held:  # the stream ended without a final event (the worker's engine failed): hand over what came
        held.append(b"")
        yield b"\n".join(held)
