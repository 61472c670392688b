"""In-process engine loops, the engine benchmarks' shared clockwork.

A `ClosedLoop` keeps c requests submitted to one engine and advances a step at a time on
its own clock (the sum of its own steps). Several loops (one per arm: a KV format, a
weight format, the check on or off) are stepped in turn (`step_in_turn`, the order rotated
every round), so a burst of load on this shared machine lands on every arm rather than on
whichever ran last. `DecodeLoop` also times the decode-only steps (every request already
has a token), the figure decode throughput is read from. `prefill_tok_s` times one long
prompt per engine in turn. `open_loop` adds requests on a schedule (arrivals that do not wait
for answers: a burst, a flood) and steps until every one has ended.

Each of them first freezes the heap built so far (`backend.heap.freeze_heap`), as a server does before it listens:
a full garbage collection walking the ~190,000 objects of a process holding torch and engines takes ~0.1 s, which
would land in one arm's step (one in `bench integrity`'s twelve repetitions widened its interval from 1.6 to 3.2
points) where a server would have frozen them.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from backend.heap import freeze_heap
from ops.bench.harness.stats import percentile, rotated

__all__ = ["ClosedLoop", "SweepRow", "DecodeLoop", "DecodeRow", "decode_row", "step_in_turn", "prefill_tok_s",
           "OpenLoopRun", "open_loop"]


@dataclass
class SweepRow:
    """One arm's closed loop at one offered concurrency (`kv`: the arm's name)."""

    kv: str
    concurrency: int  # offered: requests kept submitted
    requests: int
    admitted: int  # most RUNNING at once
    output_tok_s: float
    ttft_p50_s: float
    ttft_p95_s: float
    tpot_p50_s: float
    tpot_p95_s: float
    wall_s: float


class ClosedLoop:
    """One format's closed loop at one offered concurrency, advanced a step at a time.

    Keeps `c` requests submitted until `requests` are done. Time is the loop's own
    clock: the sum of its own steps (submits and bookkeeping included), so two loops
    stepped in turn each see only their own work, and a burst of load on the machine
    lands on both.
    """

    def __init__(self, engine: Any, kv: str, prompts: list[list[int]], c: int, requests: int,
                 output_tokens: int) -> None:
        from backend.sampling_params import SamplingParams

        self.engine, self.kv, self.c, self.requests = engine, kv, c, requests
        self.params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
        self.pending = deque(prompts[i % len(prompts)] for i in range(requests))
        self.inflight: dict[str, list[float | None]] = {}  # request id -> [submit, first token] (own clock)
        self.clock = 0.0
        self.admitted = self.tokens = 0
        self.ttft: list[float] = []
        self.tpot: list[float] = []

    @property
    def done(self) -> bool:
        return not self.pending and not self.inflight

    def step(self) -> None:
        t0 = time.perf_counter()
        own = lambda wall: self.clock + (wall - t0)  # noqa: E731
        while self.pending and len(self.inflight) < self.c:
            seq = self.engine.add_request(self.pending.popleft(), self.params)
            self.inflight[seq.request_id] = [own(time.perf_counter()), None]
        outputs = self.engine.step()
        self.admitted = max(self.admitted, len(self.engine.scheduler.running))
        for out in outputs:
            if out.error is not None:
                raise out.error
            times = self.inflight[out.seq.request_id]
            if out.new_token is not None and times[1] is None:
                times[1] = own(out.token_time)
            if out.finished:
                del self.inflight[out.seq.request_id]
                n = len(out.seq.output_ids)
                self.tokens += n
                self.ttft.append(times[1] - times[0])
                if n > 1:
                    self.tpot.append((own(out.token_time) - times[1]) / (n - 1))
        self.clock = own(time.perf_counter())

    def row(self) -> SweepRow:
        return SweepRow(self.kv, self.c, self.requests, self.admitted, self.tokens / self.clock,
                        percentile(self.ttft, 0.5), percentile(self.ttft, 0.95),
                        percentile(self.tpot, 0.5), percentile(self.tpot, 0.95), self.clock)


@dataclass
class DecodeRow:
    """One arm's decode steps at one concurrency and repetition."""

    setting: str
    concurrency: int
    repeat: int
    decode_tok_s: float
    tpot_p50_s: float
    tpot_p95_s: float
    decode_steps: int
    decode_s: float
    wall_s: float  # own clock, prefill included


class DecodeLoop(ClosedLoop):
    """A `ClosedLoop` that also times its decode-only steps (every request already has a token), in wall
    and process CPU seconds."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.decode_steps: list[tuple[float, int]] = []  # (own-clock seconds, requests in the step)
        self.decode_cpu: list[float] = []  # process CPU seconds per decode step

    def step(self) -> None:
        decode = not self.pending and all(times[1] is not None for times in self.inflight.values())
        running, before, cpu = len(self.inflight), self.clock, time.process_time()
        super().step()
        if decode and running:
            self.decode_steps.append((self.clock - before, running))
            self.decode_cpu.append(time.process_time() - cpu)

    def decode_row(self, repeat: int) -> DecodeRow:
        return decode_row(self.kv, self.c, repeat, self.decode_steps, self.clock)

    def median_tok_s(self) -> float:
        """The median over decode steps of requests in the step / its time: robust to a burst of other
        processes' load stretching a few steps by up to seconds, which a mean would count. Per step, not
        c / the median time: where the c prompts take several steps to prefill, the first requests end
        before the last ones start, and a decode step holds fewer than c (at c = 64 in `bench weights`
        before 2026-12-04: 2-22, which c / median time overstated 1.9x)."""
        return statistics.median(n / dt for dt, n in self.decode_steps)


def decode_row(setting: str, c: int, repeat: int, steps: list[tuple[float, int]], wall_s: float) -> DecodeRow:
    """Decode tok/s and per-token gap percentiles from (seconds, requests) per decode step."""
    seconds = sum(dt for dt, _ in steps)
    tokens = sum(n for _, n in steps)
    gaps = [dt for dt, n in steps for _ in range(n)]
    return DecodeRow(setting, c, repeat, tokens / seconds if seconds else float("nan"), percentile(gaps, 0.5),
                     percentile(gaps, 0.95), len(steps), seconds, wall_s)


def step_in_turn(loops: list[ClosedLoop]) -> None:
    """Step every unfinished loop once per round until all are done, the order rotated by one each
    round (with two loops: the first mover alternates)."""
    freeze_heap()
    loops = list(loops)
    r = 0
    while not all(loop.done for loop in loops):
        for loop in rotated(loops, r):
            if not loop.done:
                loop.step()
        r += 1


def prefill_tok_s(engines: dict[str, Any], prompt: list[int], repeats: int) -> dict[str, float]:
    """Prefill tok/s per engine: `prompt` as one step (the engines' chunk must hold it), engines in
    turn with the order reversed each round, one untimed warm-up round; tokens / median seconds."""
    from backend.sampling_params import SamplingParams

    freeze_heap()
    times: dict[str, list[float]] = {name: [] for name in engines}
    order = list(engines)
    for rep in range(-1, repeats):  # rep -1: warm-up (a first long step pays for its buffers)
        for name in order:
            engines[name].add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
            t0 = time.perf_counter()
            while engines[name].has_work():
                engines[name].step()
            if rep >= 0:
                times[name].append(time.perf_counter() - t0)
        order.reverse()
    return {name: len(prompt) / statistics.median(v) for name, v in times.items()}


@dataclass
class OpenLoopRun:
    """What `open_loop` saw, per request i in the order added (perf_counter seconds)."""

    start: float
    arrivals: list[float]  # when request i was added
    seqs: list[Any]  # its Sequence
    first: list[float]  # the end of the step that gave it its first token
    ended: list[float]  # the end of the step that finished it

    def ttft(self, i: int) -> float:
        return self.first[i] - self.arrivals[i]


def open_loop(engine: Any, due_s: Sequence[float], add: Callable[[int], Any]) -> OpenLoopRun:
    """Add request i (`add(i)` adds it to `engine` and returns its Sequence) once `due_s[i]` seconds (ascending)
    have passed since the start, stepping `engine` meanwhile (sleeping while it has nothing to do), until every
    request is added and finished."""
    freeze_heap()
    n = len(due_s)
    run = OpenLoopRun(time.perf_counter(), [], [], [0.0] * n, [0.0] * n)
    has_first, has_ended = [False] * n, [False] * n
    while len(run.seqs) < n or engine.has_work():
        now = time.perf_counter()
        while len(run.seqs) < n and now - run.start >= due_s[len(run.seqs)]:
            run.arrivals.append(now)
            run.seqs.append(add(len(run.seqs)))
        if engine.has_work():
            engine.step()
        elif len(run.seqs) < n:
            time.sleep(max(0.0, run.start + due_s[len(run.seqs)] - now))
        done = time.perf_counter()
        for i, s in enumerate(run.seqs):
            if not has_first[i] and s.output_ids:
                run.first[i], has_first[i] = done, True
            if not has_ended[i] and s.finish_reason is not None:
                run.ended[i], has_ended[i] = done, True
    return run
