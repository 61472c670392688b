"""The systems `edgeserve bench engine` times on one workload, and their raw timings.

- `bench_ours`: our engine in-process, a closed loop at concurrency c (a new request is submitted as soon as
  one finishes), continuous batching.
- `bench_hf`: `transformers` `generate` in static batches of c left-padded requests (c = 1: one at a time); a
  batch runs until its longest request is done and only requested tokens count.

TTFT = first token time - submit time; TPOT = (last - first) / (tokens - 1), per request.

`transformers` runs in the faster of the compute dtype and float32 on this host (``--hf-dtype auto``):
where the CPU has no bfloat16 units, torch's bfloat16 GEMMs are emulated (3.8-5x slower than float32 at
a 32-row decode step or a 100-token prompt on an AVX2-only host), and a comparator run in its slowest
form would flatter every ratio. `pick_hf_dtype` times a prompt forward and a decode-batch forward in
both and keeps the faster; the report records its choice and the timings (``hf_dtype``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from backend.heap import freeze_heap
from ops.bench.harness.progress import log
from ops.bench.harness.stats import percentile

__all__ = ["Result", "Timings", "bench_ours", "bench_hf", "pick_hf_dtype"]


@dataclass
class Result:
    system: str
    concurrency: int  # edgeserve: closed-loop concurrency; hf_batched: batch size; hf_sequential: 1
    output_tok_s: float
    ttft_p50_s: float
    ttft_p95_s: float
    tpot_p50_s: float
    tpot_p95_s: float
    requests: int
    output_tokens: int
    workload: int = 0  # the concurrency level whose requests ran (hf_sequential runs every level's)
    round: int = -1  # -1: pooled over rounds


@dataclass
class Timings:
    """One system's raw timings on one workload (or several, pooled with `+`)."""

    wall_s: float = 0.0
    tokens: int = 0
    requests: int = 0
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)

    def __add__(self, other: Timings) -> Timings:
        return Timings(self.wall_s + other.wall_s, self.tokens + other.tokens, self.requests + other.requests,
                       self.ttft + other.ttft, self.tpot + other.tpot)

    def result(self, system: str, c: int, workload: int, rnd: int = -1) -> Result:
        return Result(system, c, self.tokens / self.wall_s if self.wall_s else float("nan"),
                      percentile(self.ttft, 0.5), percentile(self.ttft, 0.95), percentile(self.tpot, 0.5),
                      percentile(self.tpot, 0.95), self.requests, self.tokens, workload, rnd)


def bench_ours(engine, reqs: list[tuple[list[int], int]], c: int, temperature: float = 0.0,
               top_p: float = 1.0) -> Timings:
    """`reqs` through our engine in a closed loop at concurrency `c` (greedy, or sampled at `temperature`
    and `top_p`)."""
    from backend.sampling_params import SamplingParams

    freeze_heap()  # as a server before it listens (`ops.bench.harness.loops`)
    pending = list(reqs)
    inflight = {}
    ttft, tpot, tokens = [], [], 0
    t0 = time.perf_counter()
    while pending or inflight:
        while pending and len(inflight) < c:
            ids, n = pending.pop(0)
            seq = engine.add_request(ids, SamplingParams(max_tokens=n, temperature=temperature, top_p=top_p,
                                                          ignore_eos=True))
            inflight[seq.request_id] = seq
        for out in engine.step():
            if out.finished:
                s = inflight.pop(out.seq.request_id)
                done = time.perf_counter()
                tokens += len(s.output_ids)
                ttft.append(s.first_token_time - s.arrival_time)
                if len(s.output_ids) > 1:
                    tpot.append((done - s.first_token_time) / (len(s.output_ids) - 1))
    return Timings(time.perf_counter() - t0, tokens, len(reqs), ttft, tpot)


class _Clock:
    """A `transformers` streamer that only records when each step's tokens appear."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:  # first call: the prompt; then one call per generated step
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def bench_hf(model, reqs: list[tuple[list[int], int]], batch: int, pad_id: int, temperature: float = 0.0,
             top_p: float = 1.0) -> Timings:
    """`reqs` through `transformers` generate in static batches of `batch` (1: one at a time; greedy, or
    sampled at `temperature` and `top_p` with its top-k filter off, as ours)."""
    freeze_heap()
    ttft, tpot, tokens = [], [], 0
    t0 = time.perf_counter()
    for i in range(0, len(reqs), batch):
        group = reqs[i: i + batch]
        width = max(len(ids) for ids, _ in group)
        input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids, _ in group])
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _ in group])
        steps = max(n for _, n in group)
        clock = _Clock()
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                           do_sample=temperature > 0, pad_token_id=pad_id, streamer=clock,
                           **({"temperature": temperature, "top_k": 0, "top_p": top_p} if temperature > 0 else {}))
        step_times = clock.times[1:]
        for _, n in group:
            tokens += n
            ttft.append(step_times[0] - start)
            if n > 1:
                tpot.append((step_times[n - 1] - step_times[0]) / (n - 1))
    return Timings(time.perf_counter() - t0, tokens, len(reqs), ttft, tpot)


def _forward_s(model, batch: int, length: int) -> float:
    """The faster of two timed forwards of `batch` x `length` token ids (after one untimed)."""
    ids = torch.randint(0, 1000, (batch, length))
    with torch.inference_mode():
        model(ids)
        times = []
        for _ in range(2):
            t = time.perf_counter()
            model(ids)
            times.append(time.perf_counter() - t)
    return min(times)


def pick_hf_dtype(model, dtype: torch.dtype, choice: str) -> tuple[torch.nn.Module, dict[str, object]]:
    """`model` (loaded in float32) in the dtype `transformers` runs in: `choice` when it names one
    ("same": `dtype`); "auto" times a 64-token prompt forward plus a 16-row decode forward in
    float32 and in `dtype` and keeps the faster. Returns the model and what was decided and why."""
    fixed = {"same": dtype, "float32": torch.float32, "bfloat16": torch.bfloat16}.get(choice)
    if fixed is not None or dtype == torch.float32:
        target = fixed or torch.float32
        return model.to(target), {"dtype": str(target).removeprefix("torch."), "chosen_by": choice}
    timed = {}
    for candidate in (torch.float32, dtype):
        model = model.to(candidate)
        timed[str(candidate).removeprefix("torch.")] = _forward_s(model, 1, 64) + _forward_s(model, 16, 1)
    best = min(timed, key=timed.get)
    log("transformers dtype: " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in timed.items()) + f" -> {best}")
    return model.to(getattr(torch, best)), {"dtype": best, "chosen_by": "auto", "probe_s": timed}
