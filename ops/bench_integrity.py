"""KV page integrity check overhead: decode throughput and TPOT p95 with the check on and off.

Two engines on the same model weights, identical but for
``EngineConfig(kv_format="fp8_e4m3", integrity_check=True / False)``. At each
concurrency c (8, 32, 64; ``--quick``: 8, 16) both get the same c requests of
P prompt + O output tokens (64 + 64; quick 48 + 32), all submitted at once, greedy,
EOS ignored: one wave, so after the first few steps every step is pure decode.

The two loops run side by side, one engine step each in turn (the first mover
alternating), each with its own clock, the sum of its own steps; this reuses
`ops.bench_kv.ClosedLoop`. Load on this shared machine comes in bursts that would
land on one setting if they ran one after the other; stepped in turn a burst lands
on both. The whole sweep is repeated R times (quick 2, full 3) to show the spread.

Decode steps only: prefill of c * P tokens is a few large steps whose time swings
with the machine far more than the check costs, so it is left out of both figures.
A step counts as decode if, before it, every request had its first token.
- decode tok/s = tokens of decode steps / time of decode steps (own clock);
- TPOT p95 = nearest-rank 95th percentile of the per-token gaps over every
  request's decode tokens (each decode step contributes its time once per request
  in it; vLLM calls this inter-token latency).
Overheads, per repetition, in percent: throughput (off - on) / off, p95
(on - off) / off; positive means the check costs. Reported: the median over
repetitions and its spread (min, max). The target from the public write-up is
under 1% on both.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

from ops.bench import write_report

from ops.bench_engine import percentile
from ops.bench_kv import ClosedLoop, fixed_length_prompts

__all__ = ["add_arguments", "run", "DecodeLoop", "DecodeRow", "step_in_turn", "overhead_pct", "spread",
           "concurrency_points"]

SETTINGS: dict[str, bool] = {"on": True, "off": False}  # report name -> EngineConfig.integrity_check


@dataclass
class DecodeRow:
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
    """A `ClosedLoop` that also times its decode-only steps (every request already has a token)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.decode_steps: list[tuple[float, int]] = []  # (own-clock seconds, requests in the step)

    def step(self) -> None:
        decode = not self.pending and all(times[1] is not None for times in self.inflight.values())
        running, before = len(self.inflight), self.clock
        super().step()
        if decode and running:
            self.decode_steps.append((self.clock - before, running))

    def decode_row(self, repeat: int) -> DecodeRow:
        return decode_row(self.kv, self.c, repeat, self.decode_steps, self.clock)


def decode_row(setting: str, c: int, repeat: int, steps: list[tuple[float, int]], wall_s: float) -> DecodeRow:
    """Decode tok/s and per-token gap percentiles from (seconds, requests) per decode step."""
    seconds = sum(dt for dt, _ in steps)
    tokens = sum(n for _, n in steps)
    gaps = [dt for dt, n in steps for _ in range(n)]
    return DecodeRow(setting, c, repeat, tokens / seconds if seconds else float("nan"), percentile(gaps, 0.5),
                     percentile(gaps, 0.95), len(steps), seconds, wall_s)


def step_in_turn(loops: list) -> None:
    """Step every unfinished loop once per round until all are done, the first mover alternating."""
    loops = list(loops)
    while not all(loop.done for loop in loops):
        for loop in loops:
            if not loop.done:
                loop.step()
        loops.reverse()


def overhead_pct(on: float, off: float, higher_is_better: bool) -> float:
    """Cost of the check in percent of the unchecked figure (positive: the check makes it worse)."""
    return 100.0 * ((off - on) if higher_is_better else (on - off)) / off


def spread(values: list[float]) -> dict[str, float]:
    """Median, min and max of repeated measurements."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def concurrency_points(quick: bool) -> list[int]:
    return [8, 16] if quick else [8, 32, 64]


def overheads(rows: list[DecodeRow]) -> dict[str, dict[int, list[float]]]:
    """Per concurrency, the per-repetition overheads (percent) of throughput and TPOT p95."""
    by = {(r.setting, r.concurrency, r.repeat): r for r in rows}
    out: dict[str, dict[int, list[float]]] = {"throughput": {}, "p95": {}}
    for c, rep in sorted({(r.concurrency, r.repeat) for r in rows}):
        on, off = by[("on", c, rep)], by[("off", c, rep)]
        out["throughput"].setdefault(c, []).append(overhead_pct(on.decode_tok_s, off.decode_tok_s, True))
        out["p95"].setdefault(c, []).append(overhead_pct(on.tpot_p95_s, off.tpot_p95_s, False))
    return out


# ---------------------------------------------------------------- command

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype")
    p.add_argument("--concurrency", default=None, help="comma-separated (default 8,32,64; quick 8,16)")
    p.add_argument("--repeats", type=int, default=None, help="R (default 3; quick 2)")
    p.add_argument("--prompt-tokens", type=int, default=None, help="P (default 64; quick 48)")
    p.add_argument("--output-tokens", type=int, default=None, help="O (default 64; quick 32)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=None)


def run(args: argparse.Namespace) -> int:
    from backend.engine import DTYPES, EngineConfig, LLMEngine
    from backend.model import LlamaModel
    from backend.tokenizer import Tokenizer
    from ops.pull import resolve_model

    quick = args.quick
    points = [int(c) for c in args.concurrency.split(",")] if args.concurrency else concurrency_points(quick)
    repeats = args.repeats or (2 if quick else 3)
    prompt_tokens = args.prompt_tokens or (48 if quick else 64)  # the chat template takes 30
    output_tokens = args.output_tokens or (32 if quick else 64)
    if args.threads:
        torch.set_num_threads(args.threads)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    started = time.perf_counter()

    model_dir = resolve_model(args.model)
    tok = Tokenizer.from_model_dir(model_dir)
    model = LlamaModel.from_pretrained(model_dir, DTYPES[args.dtype], EngineConfig().gemm_buckets)
    prompts = fixed_length_prompts(tok, max(points), prompt_tokens)
    configs = {name: EngineConfig(dtype=args.dtype, kv_format="fp8_e4m3", integrity_check=check,
                                  page_size=args.page_size, max_num_seqs=max(points))
               for name, check in SETTINGS.items()}
    engines = {name: LLMEngine(model, cfg, tok) for name, cfg in configs.items()}

    step_in_turn([DecodeLoop(e, name, prompts, 2, 2, 4) for name, e in engines.items()])  # warm-up
    rows: list[DecodeRow] = []
    for rep in range(repeats):
        for c in points:
            loops = [DecodeLoop(e, name, prompts, c, c, output_tokens) for name, e in engines.items()]
            step_in_turn(loops)
            for loop in loops:
                row = loop.decode_row(rep)
                rows.append(row)
                log(f"rep {rep} c={c:<3} check {row.setting:<3}: {row.decode_tok_s:7.1f} decode tok/s, "
                    f"TPOT p95 {1e3 * row.tpot_p95_s:6.1f} ms, {row.decode_steps} decode steps, {row.wall_s:.1f} s")
    stats = {name: {k: v for k, v in e.snapshot().items() if k.startswith("integrity")} for name, e in engines.items()}
    if stats["on"]["integrity_checks"] == 0 or stats["off"]["integrity_checks"] != 0:
        log(f"warning: the check did not run as configured: {stats}")
    over = overheads(rows)
    total_s = time.perf_counter() - started

    print(f"\nedgeserve bench integrity  model={args.model} dtype={args.dtype} kv=fp8_e4m3 "
          f"threads={torch.get_num_threads()}{' (quick)' if quick else ''}")
    print(f"{prompt_tokens} prompt + {output_tokens} output tokens per request, one wave of c requests, "
          f"{repeats} repetitions, decode steps only; medians over repetitions [min, max]")
    print(f"{'conc':>5}{'tok/s off':>11}{'tok/s on':>10}{'overhead %':>22}{'p95 ms off':>12}{'p95 ms on':>11}"
          f"{'overhead %':>22}")
    for c in points:
        med = lambda setting, field: statistics.median(  # noqa: E731
            getattr(r, field) for r in rows if r.setting == setting and r.concurrency == c)
        t, p = spread(over["throughput"][c]), spread(over["p95"][c])
        print(f"{c:>5}{med('off', 'decode_tok_s'):>11.1f}{med('on', 'decode_tok_s'):>10.1f}"
              f"{t['median']:>+8.2f} [{t['min']:+.2f}, {t['max']:+.2f}]"
              f"{1e3 * med('off', 'tpot_p95_s'):>12.2f}{1e3 * med('on', 'tpot_p95_s'):>11.2f}"
              f"{p['median']:>+8.2f} [{p['min']:+.2f}, {p['max']:+.2f}]")
    print(f"checks run: on {stats['on']['integrity_checks']}, off {stats['off']['integrity_checks']}; "
          f"aborts {stats['on']['integrity_aborts']}; took {total_s:.0f} s")

    report = {
        "model": args.model, "dtype": args.dtype, "threads": torch.get_num_threads(), "quick": quick,
        "config": {"kv_format": "fp8_e4m3", "concurrency": points, "repeats": repeats,
                   "prompt_tokens": prompt_tokens, "output_tokens": output_tokens, "page_size": args.page_size,
                   "max_num_seqs": max(points), "measured": "decode steps only, own clocks, stepped in turn"},
        "overhead_throughput_pct": {str(c): statistics.median(v) for c, v in over["throughput"].items()},
        "overhead_p95_pct": {str(c): statistics.median(v) for c, v in over["p95"].items()},
        "spread": {"throughput_pct": {str(c): spread(v) | {"per_repeat": v} for c, v in over["throughput"].items()},
                   "p95_pct": {str(c): spread(v) | {"per_repeat": v} for c, v in over["p95"].items()}},
        "rows": [asdict(r) for r in rows],
        "engine_stats": stats,
        "total_s": total_s,
    }
    write_report(args.json_path, report)
    return 0
