"""Engine throughput and latency vs `transformers` generate (sequential and static batches).

Every system gets the same requests: chat-templated prompts of varied length and
fixed per-request output lengths (EOS ignored), greedy. Systems:

- ``edgeserve``: our engine in-process, closed loop at concurrency c (a new
  request is submitted as soon as one finishes), continuous batching.
- ``hf_sequential``: `transformers` `generate`, one request at a time (measured
  once; every concurrency level is compared with its throughput).
- ``hf_batched``: `generate` on static batches of c left-padded requests; a batch
  runs until its longest request is done and only requested tokens count.

TTFT = first token time - submit time; TPOT = (last - first) / (tokens - 1),
per request. The machine's bounds are measured in the same run: read bandwidth
(a large tensor reduction) and the GEMM rate in the compute dtype, giving
%-of-bound = throughput / (bandwidth / weight bytes per token) at c=1 and
throughput / (GEMM rate / 2 * params FLOPs per token) at c=32.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ops.bench import write_report

__all__ = ["add_arguments", "run", "percentile", "prefill_tok_s", "TOPICS"]

TOPICS = ["the sea", "a city at night", "learning to cook", "the history of maps", "a long train journey",
          "why the sky is blue", "a friendly robot", "how bridges stand up", "autumn leaves", "the first computer",
          "a mountain village", "sleep and dreams", "volcanoes", "a lost umbrella", "chess openings", "bees"]


@dataclass
class Result:
    system: str
    concurrency: int
    output_tok_s: float
    ttft_p50_s: float
    ttft_p95_s: float
    tpot_p50_s: float
    tpot_p95_s: float
    requests: int
    output_tokens: int


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="compute dtype for every system (float32 is the faster CPU path here; see BENCHMARKS.md)")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--skip-hf", action="store_true", help="measure only our engine")


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]); NaN for no values."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def _make_workload(tokenizer, n: int, out_lo: int, out_hi: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        extra = " Please be detailed and give examples." * rng.randint(0, 12)
        msg = [{"role": "user", "content": f"Write a short essay about {topic}.{extra}"}]
        ids = tokenizer.encode(tokenizer.apply_chat_template(msg, add_generation_prompt=True))
        reqs.append((ids, rng.randint(out_lo, out_hi)))
    return reqs


def _summarise(system: str, c: int, wall: float, ttft: list[float], tpot: list[float], tokens: int,
               n: int) -> Result:
    return Result(system, c, tokens / wall, percentile(ttft, 0.5), percentile(ttft, 0.95),
                  percentile(tpot, 0.5), percentile(tpot, 0.95), n, tokens)


def bench_ours(engine, reqs: list[tuple[list[int], int]], c: int) -> Result:
    from backend.sampling_params import SamplingParams

    pending = list(reqs)
    inflight = {}
    ttft, tpot, tokens = [], [], 0
    t0 = time.perf_counter()
    while pending or inflight:
        while pending and len(inflight) < c:
            ids, n = pending.pop(0)
            seq = engine.add_request(ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
            inflight[seq.request_id] = seq
        for out in engine.step():
            if out.finished:
                s = inflight.pop(out.seq.request_id)
                done = time.perf_counter()
                tokens += len(s.output_ids)
                ttft.append(s.first_token_time - s.arrival_time)
                if len(s.output_ids) > 1:
                    tpot.append((done - s.first_token_time) / (len(s.output_ids) - 1))
    return _summarise("edgeserve", c, time.perf_counter() - t0, ttft, tpot, tokens, len(reqs))


class _Clock:
    """A `transformers` streamer that only records when each step's tokens appear."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:  # first call: the prompt; then one call per generated step
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def bench_hf(model, reqs: list[tuple[list[int], int]], batch: int, pad_id: int) -> Result:
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
                           do_sample=False, pad_token_id=pad_id, streamer=clock)
        step_times = clock.times[1:]
        for _, n in group:
            tokens += n
            ttft.append(step_times[0] - start)
            if n > 1:
                tpot.append((step_times[n - 1] - step_times[0]) / (n - 1))
    name = "hf_sequential" if batch == 1 else "hf_batched"
    return _summarise(name, batch, time.perf_counter() - t0, ttft, tpot, tokens, len(reqs))


def _gemm_rate(dtype: torch.dtype) -> float:
    a, b = torch.randn(2048, 2048, dtype=dtype), torch.randn(2048, 2048, dtype=dtype)
    a @ b
    reps, t = 5, time.perf_counter()
    for _ in range(reps):
        a @ b
    return reps * 2 * 2048**3 / (time.perf_counter() - t) / 1e9


def measure_machine(dtype: torch.dtype) -> dict[str, float]:
    """Read bandwidth (GB/s) from reducing a 1 GiB tensor; 2048^3 GEMM rates (GFLOP/s) in
    the compute dtype (the bound used) and in BF16."""
    big = torch.ones(2**28, dtype=torch.float32)  # 1 GiB
    big.sum()
    reps, t = 5, time.perf_counter()
    for _ in range(reps):
        big.sum()
    bandwidth = reps * big.numel() * 4 / (time.perf_counter() - t) / 1e9
    del big
    return {"read_gb_s": bandwidth, "gemm_gflop_s": _gemm_rate(dtype), "bf16_gemm_gflop_s": _gemm_rate(torch.bfloat16)}


def run(args: argparse.Namespace) -> int:
    from backend.engine import DTYPES, EngineConfig, LLMEngine
    from backend.tokenizer import Tokenizer
    from ops.pull import resolve_model

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    model_dir = resolve_model(args.model)
    tok = Tokenizer.from_model_dir(model_dir)
    levels = [int(c) for c in args.concurrency.split(",")]
    out_lo, out_hi = (16, 32) if args.quick else (64, 128)
    waves = 1 if args.quick else 2
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731

    machine = measure_machine(dtype)
    log(f"machine: read {machine['read_gb_s']:.1f} GB/s, {args.dtype} GEMM {machine['gemm_gflop_s']:.0f} GFLOP/s, "
        f"bfloat16 GEMM {machine['bf16_gemm_gflop_s']:.0f} GFLOP/s")
    kv_bytes = 1 << 30
    engine = LLMEngine.from_pretrained(model_dir, EngineConfig(dtype=args.dtype, kv_format="bf16"
                                                               if args.dtype == "bfloat16" else "fp32",
                                                               kv_cache_bytes=kv_bytes, max_num_seqs=max(levels)))
    workloads = {c: _make_workload(tok, max(c * waves, 3 if args.quick else 6), out_lo, out_hi, seed=c)
                 for c in levels}
    bench_ours(engine, _make_workload(tok, 2, 4, 4, seed=99), 2)  # warm-up
    results: list[Result] = []
    for c in levels:
        log(f"edgeserve c={c}: {len(workloads[c])} requests")
        results.append(bench_ours(engine, workloads[c], c))
    weight_bytes = engine.model.weight_bytes
    params = weight_bytes // dtype.itemsize
    del engine
    if not args.skip_hf:
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        pad = tok.eos_token_ids and min(tok.eos_token_ids) or 0
        _ = bench_hf(hf, _make_workload(tok, 1, 4, 4, seed=99), 1, pad)  # warm-up
        log(f"hf_sequential: {len(workloads[min(levels)])} requests")
        results.append(bench_hf(hf, workloads[min(levels)], 1, pad))
        for c in levels:
            if c > 1:
                log(f"hf_batched c={c}")
                results.append(bench_hf(hf, workloads[c], c, pad))

    by = {(r.system, r.concurrency): r for r in results}
    hf_seq = next((r for r in results if r.system == "hf_sequential"), None)
    ratio_seq = {str(c): by[("edgeserve", c)].output_tok_s / hf_seq.output_tok_s for c in levels} if hf_seq else {}
    ratio_bat = {str(c): by[("edgeserve", c)].output_tok_s / by[("hf_batched", c)].output_tok_s
                 for c in levels if ("hf_batched", c) in by}
    bound_c1 = machine["read_gb_s"] * 1e9 / weight_bytes  # tok/s if every step streams the weights once
    bound_c32 = machine["gemm_gflop_s"] * 1e9 / (2 * params)  # tok/s if every step ran at the GEMM rate
    pct = {}
    if ("edgeserve", 1) in by:
        pct["1"] = 100 * by[("edgeserve", 1)].output_tok_s / bound_c1
    top = max(levels)
    if top > 1 and ("edgeserve", top) in by:
        pct[str(top)] = 100 * by[("edgeserve", top)].output_tok_s / bound_c32

    print(f"\nedgeserve bench engine  model={args.model} dtype={args.dtype} threads={torch.get_num_threads()}"
          f"{' (quick)' if args.quick else ''}")
    print(f"machine: read {machine['read_gb_s']:.1f} GB/s, {args.dtype} GEMM {machine['gemm_gflop_s']:.0f} GFLOP/s "
          f"(bfloat16 {machine['bf16_gemm_gflop_s']:.0f}); "
          f"weights {weight_bytes / 1e6:.0f} MB -> c=1 bound {bound_c1:.0f} tok/s, GEMM bound {bound_c32:.0f} tok/s")
    print(f"{'system':<14}{'conc':>5}{'tok/s':>9}{'TTFT p50':>10}{'TTFT p95':>10}{'TPOT p50':>10}{'TPOT p95':>10}"
          f"{'vs seq':>8}{'vs batch':>9}")
    for r in sorted(results, key=lambda r: (r.concurrency, r.system)):
        vs_seq = vs_bat = ""
        if r.system == "edgeserve":
            vs_seq = f"{ratio_seq[str(r.concurrency)]:.2f}x" if str(r.concurrency) in ratio_seq else ""
            vs_bat = f"{ratio_bat[str(r.concurrency)]:.2f}x" if str(r.concurrency) in ratio_bat else ""
        print(f"{r.system:<14}{r.concurrency:>5}{r.output_tok_s:>9.1f}{r.ttft_p50_s:>10.3f}{r.ttft_p95_s:>10.3f}"
              f"{r.tpot_p50_s:>10.4f}{r.tpot_p95_s:>10.4f}{vs_seq:>8}{vs_bat:>9}")
    print("pct_of_bound: " + ", ".join(f"c={k}: {v:.0f}%" for k, v in pct.items()))

    report = {
        "model": args.model, "dtype": args.dtype, "threads": torch.get_num_threads(), "quick": args.quick,
        "machine": machine, "weight_bytes": weight_bytes,
        "results": [asdict(r) for r in results],
        "ratio_vs_hf_sequential": ratio_seq, "ratio_vs_hf_batched": ratio_bat, "pct_of_bound": pct,
    }
    write_report(args.json_path, report)
    return 0


def prefill_tok_s(engines: dict[str, Any], prompt: list[int], repeats: int) -> dict[str, float]:
    """Prefill tok/s per engine: `prompt` as one step (the engines' chunk must hold it), engines in
    turn with the order reversed each round, one untimed warm-up round; tokens / median seconds."""
    from backend.sampling_params import SamplingParams

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
