"""NDJSON framing of a generate stream (`event_frames.py`) and its reading at the gateway (`worker_client`)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

import aiohttp
import pytest

from backend.event_frames import ndjson_frames
from backend.protocol import ErrorEvent, Event, FinishEvent, Logprobs, TokenEvent, encoder, event_decoder
from backend.worker_client import _event_batches


def _events(n: int, final: Event | None = None) -> list[Event]:
    rng = random.Random(n)
    evs: list[Event] = [TokenEvent([rng.randrange(50_000)], [0.01 * i]) for i in range(n)]
    evs.insert(0, TokenEvent([], [], prompt_logprobs=Logprobs([rng.random() for _ in range(4)])))
    return [*evs, final or FinishEvent("length", 7, n, ttft_s=0.01, total_s=0.02)]


async def _source(events: list[Event], gaps: dict[int, float] | None = None) -> AsyncIterator[Event]:
    for i, ev in enumerate(events):
        if gaps and i in gaps:
            await asyncio.sleep(gaps[i])
        yield ev


async def _frames(events: list[Event], stream: bool, flush_s: float = 0.25,
                  gaps: dict[int, float] | None = None) -> list[bytes]:
    return [f async for f in ndjson_frames(_source(events, gaps), stream, flush_s)]


def test_streamed_requests_get_one_frame_per_event() -> None:
    events = _events(9)
    frames = asyncio.run(_frames(events, stream=True))
    assert frames == [encoder.encode(ev) + b"\n" for ev in events]


def _joined(events: list[Event]) -> TokenEvent:
    """What token events held together become: one event, tokens, times and logprobs in order."""
    tokens = [ev for ev in events if isinstance(ev, TokenEvent)]
    with_lp = [ev.logprobs for ev in tokens if ev.logprobs is not None]
    logprobs = None if not with_lp else Logprobs([x for lp in with_lp for x in lp.token],
                                                 [x for lp in with_lp for x in lp.top_ids],
                                                 [x for lp in with_lp for x in lp.top_logprobs])
    return TokenEvent([i for ev in tokens for i in ev.token_ids], [t for ev in tokens for t in ev.times],
                      logprobs, tokens[0].prompt_logprobs)


def test_events_ready_together_leave_in_one_frame_and_their_tokens_in_one_event_when_not_streamed() -> None:
    events = _events(32)
    before = encoder.encode(events[5])
    frames = asyncio.run(_frames(events, stream=False))
    assert len(frames) == 1
    assert event_decoder.decode_lines(frames[0]) == [_joined(events[:-1]), events[-1]]
    assert encoder.encode(events[5]) == before  # the source's events are not changed


def test_tokens_with_logprobs_join_too_but_not_with_tokens_without() -> None:
    lp = [Logprobs([-0.5 * i], [[i, i + 1]], [[-0.5 * i, -2.0]]) for i in range(4)]
    events: list[Event] = [TokenEvent([], [], prompt_logprobs=Logprobs([-1.0, -2.0])),
                           *(TokenEvent([10 + i], [0.1 * i], lp[i]) for i in range(4)),
                           FinishEvent("length", 3, 4)]
    frames = asyncio.run(_frames(events, stream=False))
    assert event_decoder.decode_lines(b"".join(frames)) == [events[0], _joined(events[1:5]), events[-1]]


def test_held_events_are_written_once_flush_s_has_passed() -> None:
    events = _events(6)  # 0: prompt logprobs, 1..6 tokens, 7 finish
    # tokens 1-2 at once, then a pause longer than flush_s before token 3: 0..3 leave together; 4..6 wait
    # for the finish, which never waits
    frames = asyncio.run(_frames(events, stream=False, flush_s=0.05, gaps={3: 0.12}))
    assert [event_decoder.decode_lines(f) for f in frames] == [[_joined(events[:4])],
                                                              [_joined(events[4:7]), events[-1]]]


def test_an_error_event_leaves_at_once_with_what_was_held() -> None:
    events = _events(3, final=ErrorEvent(3001, "BackendUnavailable", "gone", 3))
    frames = asyncio.run(_frames(events, stream=False, flush_s=60.0))
    assert len(frames) == 1 and event_decoder.decode_lines(frames[0])[-1] == events[-1]


def test_a_source_that_ends_without_a_final_event_still_hands_over_its_tokens() -> None:
    events = _events(3)[:-1]
    frames = asyncio.run(_frames(events, stream=False, flush_s=60.0))
    assert event_decoder.decode_lines(b"".join(frames)) == [_joined(events)]


@pytest.mark.parametrize("seed", range(4))
def test_the_client_decodes_lines_cut_anywhere_by_the_reads(seed: int) -> None:
    events = _events(20)
    body = b"".join(encoder.encode(ev) + b"\n" for ev in events) + b"\n"  # a blank line is skipped
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(body)), 12))
    pieces = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
    if seed == 0:
        pieces[-1] = pieces[-1].rstrip(b"\n")  # the last line without its newline is still an event

    async def read() -> list[list[Event]]:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\n"
                         b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n")
            for piece in pieces:  # one HTTP chunk and one TCP write per piece, apart in time
                writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                await writer.drain()
                await asyncio.sleep(0.005)
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server, aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/") as resp:
            return [b async for b in _event_batches(resp.content)]

    batches = asyncio.run(read())
    assert [ev for b in batches for ev in b] == events
    assert 1 < len(batches) <= len(pieces)
