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
once with whatever is held. Token events held together also become one event (their
token ids, times and logprobs concatenated in order; prompt logprobs stay on the
first), so a 32-token answer is two lines, not 33: the same tokens in fewer lines to
encode, parse and hand along. A reader that adds up events sees the same request
(the gateway reads every event's `token_ids` as a list already).

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

from backend.protocol import ErrorEvent, Event, FinishEvent, Logprobs, TokenEvent, encoder

__all__ = ["FLUSH_S", "ndjson_frames"]

FLUSH_S = 0.25  # longest time an event of a non-streamed request is held before it is written


async def ndjson_frames(events: AsyncIterator[Event], stream: bool = True,
                        flush_s: float = FLUSH_S) -> AsyncIterator[bytes]:
    """The NDJSON body of `events`: a line per frame when `stream`, else lines held up to `flush_s` (module doc)."""
    if stream:
        async for ev in events:
            yield encoder.encode(ev) + b"\n"
        return
    held: list[Event] = []
    joined: TokenEvent | None = None  # the last held event when it is ours (joined), so it may grow in place
    last_write = time.monotonic()
    async for ev in events:
        last = held[-1] if held else None
        if isinstance(ev, TokenEvent) and isinstance(last, TokenEvent) and _joinable(last, ev):
            if last is not joined:
                held[-1] = joined = _copy(last)
            _append(joined, ev)
        else:
            held.append(ev)
        now = time.monotonic()
        if isinstance(ev, (FinishEvent, ErrorEvent)) or now - last_write >= flush_s:
            yield _lines(held)
            held.clear()
            joined, last_write = None, now
    if held:  # the stream ended without a final event (the worker's engine failed): hand over what came
        yield _lines(held)


def _joinable(first: TokenEvent, then: TokenEvent) -> bool:
    """Whether `then` can be appended to `first`: both carry logprobs or neither, and prompt logprobs
    (sent once, on the first) do not arrive again."""
    return then.prompt_logprobs is None and (first.logprobs is None) == (then.logprobs is None)


def _copy(ev: TokenEvent) -> TokenEvent:
    """`ev` with lists of its own, to grow (the engine's events stay as they were)."""
    lp = ev.logprobs
    logprobs = None if lp is None else Logprobs(list(lp.token), list(lp.top_ids), list(lp.top_logprobs))
    return TokenEvent(list(ev.token_ids), list(ev.times), logprobs, ev.prompt_logprobs)


def _append(joined: TokenEvent, then: TokenEvent) -> None:
    joined.token_ids += then.token_ids
    joined.times += then.times
    if joined.logprobs is not None and then.logprobs is not None:
        joined.logprobs.extend(then.logprobs)


def _lines(held: list[Event]) -> bytes:
    return b"".join(encoder.encode(ev) + b"\n" for ev in held)
