"""KV page integrity check overhead: decode throughput and TPOT p95 with the check on and off.

Engines on the same model weights, identical but for
``EngineConfig(kv_format="fp8_e4m3", integrity_check=True / False)``: ``off``, ``on``
and, unless ``--inject-pct 0``, ``on+inject``: the check on plus a busy-wait of a
known share (default 1%) of the step inside the check path, the calibration arm. At
each concurrency c (8, 32, 64; ``--quick``: 8, 16) every arm gets the same c
requests of P prompt + O output tokens (64 + 64; quick 48 + 32), all submitted at
once, greedy, EOS ignored: one wave, so after the first steps every step is pure
decode, and the arms run in lockstep: their i-th decode steps hold the same batch.

The arms run side by side, one engine step each per round, the order rotated every
round (a Latin rotation, `ops.bench_engine.rotated`), each with its own clock (the
sum of its own steps; `ops.bench_kv.ClosedLoop`): a burst of load on this shared
machine lands on all arms, and no arm always goes first. Only decode steps count
(prefill is a few large steps whose time swings far more than the check costs); a
step counts as decode if every request had its first token before it.

Figures, per concurrency, pooled over the repetitions (B = the baseline arm, A = the
arm measured against it; `off` for `on`, `on` for `on+inject`), over paired steps:
- throughput overhead = 100 * (1 - sum of B's step seconds / sum of A's): the same
  tokens ran in both, so this is (tok/s B - tok/s A) / tok/s B;
- p95 overhead = 100 * (p95 of A's per-token gaps / B's - 1); the gaps are the step
  times, one per request in the step (vLLM's inter-token latency);
- a 95% confidence interval for each: a stratified circular block bootstrap
  (`block_bootstrap_ci`): each repetition's sequence of paired steps is resampled in
  blocks of consecutive pairs (load bursts last several steps), the statistic
  recomputed 2,000 times, the 2.5th and 97.5th percentiles taken;
- the check's own time as a share of the step: `CheckTimer` wraps the engine's
  `_check_integrity` and times every call; share = check seconds in the on arm's
  decode steps / those steps' seconds, from the same run.
Repetitions go on (at least ``--repeats``) until every interval is narrower than
``--ci-width`` points or ``--max-repeats`` is reached.

How we know a real 1% cost is separated from noise: the ``on+inject`` arm costs
exactly the busy-wait it spins (recorded, ~1% of each of its decode steps) and is
measured against ``on`` by the same method in the same run. Its interval must hold
the injected share and exclude 0 (`detected`); if it does not, the run cannot
resolve 1% and says so. Targets: under 1% on throughput and p95 (met when the
interval's upper end is under 1: shown, not just a median).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch

from ops.bench import write_report
from ops.bench_engine import percentile, rotated, spread
from ops.bench_kv import ClosedLoop, fixed_length_prompts

__all__ = ["add_arguments", "run", "DecodeLoop", "DecodeRow", "CheckTimer", "step_in_turn", "overhead_pct",
           "spread", "concurrency_points", "decode_row", "throughput_overhead", "p95_overhead",
           "step_overhead", "block_bootstrap_ci", "busy_wait", "COMPARISONS"]

ARMS: dict[str, bool] = {"off": False, "on": True, "on+inject": True}  # arm -> EngineConfig.integrity_check
COMPARISONS: dict[str, tuple[str, str]] = {"check": ("on", "off"), "inject": ("on+inject", "on")}  # (A, B)


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


class CheckTimer:
    """Times one engine's `_check_integrity` (it replaces the bound method on the instance) and, when
    `spin_s` > 0, busy-waits that long inside it after the check: a known cost in the check path."""

    def __init__(self, engine) -> None:
        self.seconds = 0.0  # time inside the check itself, all calls
        self.spun = 0.0  # time busy-waited, all calls
        self.calls = 0
        self.spin_s = 0.0
        inner = engine._check_integrity

        def timed(batch):
            t0 = time.perf_counter()
            try:
                return inner(batch)
            finally:
                t1 = time.perf_counter()
                self.seconds += t1 - t0
                self.calls += 1
                if self.spin_s > 0:
                    self.spun += busy_wait(self.spin_s)

        engine._check_integrity = timed


def busy_wait(seconds: float) -> float:
    """Spin (holding the CPU and the GIL, like real work) for `seconds`; the time actually spent."""
    t0 = time.perf_counter()
    end = t0 + seconds
    while time.perf_counter() < end:
        pass
    return time.perf_counter() - t0


class DecodeLoop(ClosedLoop):
    """A `ClosedLoop` that also times its decode-only steps (every request already has a token). With a
    `CheckTimer` it records each decode step's check and spin seconds, and, when `inject` > 0, sets
    the next step's spin to `inject` times this step's time without its spin."""

    def __init__(self, *args, timer: CheckTimer | None = None, inject: float = 0.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.decode_steps: list[tuple[float, int]] = []  # (own-clock seconds, requests in the step)
        self.check_s: list[float] = []  # per decode step, with a timer
        self.spin_s: list[float] = []
        self.timer, self.inject = timer, inject

    def step(self) -> None:
        decode = not self.pending and all(times[1] is not None for times in self.inflight.values())
        running, before = len(self.inflight), self.clock
        checked, spun = (self.timer.seconds, self.timer.spun) if self.timer else (0.0, 0.0)
        super().step()
        if decode and running:
            dt = self.clock - before
            self.decode_steps.append((dt, running))
            if self.timer:
                self.check_s.append(self.timer.seconds - checked)
                self.spin_s.append(self.timer.spun - spun)
                self.timer.spin_s = self.inject * (dt - self.spin_s[-1])

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
    """Step every unfinished loop once per round until all are done, the order rotated by one each
    round (with two loops: the first mover alternates)."""
    loops = list(loops)
    r = 0
    while not all(loop.done for loop in loops):
        for loop in rotated(loops, r):
            if not loop.done:
                loop.step()
        r += 1


def overhead_pct(on: float, off: float, higher_is_better: bool) -> float:
    """Cost of the check in percent of the unchecked figure (positive: the check makes it worse)."""
    return 100.0 * ((off - on) if higher_is_better else (on - off)) / off


def concurrency_points(quick: bool) -> list[int]:
    return [8, 16] if quick else [8, 32, 64]


# ---------------------------------------------------------------- statistics over paired steps

def throughput_overhead(a: np.ndarray, b: np.ndarray) -> float:
    """Percent of B's throughput that A loses, from paired step seconds (same tokens in both)."""
    return 100.0 * (1.0 - float(b.sum()) / float(a.sum()))


def step_overhead(a: np.ndarray, b: np.ndarray) -> float:
    """Percent by which A's typical step exceeds B's: the median of the paired ratios a[i] / b[i]. A burst
    of load that lands on one side of a pair moves it no more than any other pair (robust where the
    throughput figure, a ratio of sums, takes the burst's whole length)."""
    return 100.0 * (float(np.median(a / b)) - 1.0)


def p95_overhead(a: np.ndarray, b: np.ndarray) -> float:
    """Percent by which A's step-time p95 exceeds B's (nearest rank, as `percentile`)."""
    return 100.0 * (percentile(a.tolist(), 0.95) / percentile(b.tolist(), 0.95) - 1.0)


def block_bootstrap_ci(strata: Sequence[tuple[Sequence[float], Sequence[float]]],
                       statistic: Callable[[np.ndarray, np.ndarray], float], block: int = 4,
                       resamples: int = 2000, level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile interval of `statistic(a, b)` under a stratified circular block bootstrap.

    `strata` holds paired series (a[i] and b[i] measured side by side); each stratum (a
    repetition) is resampled on its own, in runs of `block` consecutive pairs (wrapping
    round at the end, so the first and last pairs are drawn as often as the rest), so a
    burst that spans several steps stays one unit. Pairs stay together."""
    rng = np.random.default_rng(seed)
    picks = []
    for a, b in strata:
        n = min(len(a), len(b))
        if n == 0:
            continue
        width = min(block, n)
        starts = rng.integers(0, n, size=(resamples, -(-n // width)))
        picks.append((np.asarray(a[:n], float), np.asarray(b[:n], float),
                      ((starts[:, :, None] + np.arange(width)) % n).reshape(resamples, -1)[:, :n]))
    if not picks:
        return float("nan"), float("nan")
    values = [statistic(np.concatenate([a[idx[r]] for a, _, idx in picks]),
                        np.concatenate([b[idx[r]] for _, b, idx in picks])) for r in range(resamples)]
    lo, hi = np.quantile(values, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def compare(loops: dict[tuple[str, int], list[DecodeLoop]], arm_a: str, arm_b: str, c: int) -> dict[str, object]:
    """Overheads of `arm_a` against `arm_b` at concurrency c over every repetition's paired decode steps,
    with bootstrap intervals; `loops[(arm, c)]` holds one loop per repetition, in order."""
    strata = []
    for la, lb in zip(loops[(arm_a, c)], loops[(arm_b, c)], strict=True):
        n = min(len(la.decode_steps), len(lb.decode_steps))
        strata.append(([dt for dt, _ in la.decode_steps[:n]], [dt for dt, _ in lb.decode_steps[:n]]))
    a = np.concatenate([np.asarray(s[0]) for s in strata])
    b = np.concatenate([np.asarray(s[1]) for s in strata])
    out: dict[str, object] = {"pairs": int(a.size)}
    for name, stat in (("throughput", throughput_overhead), ("step", step_overhead), ("p95", p95_overhead)):
        lo, hi = block_bootstrap_ci(strata, stat)
        out[f"{name}_pct"] = stat(a, b)
        out[f"{name}_ci95"] = [lo, hi]
        out[f"{name}_per_repeat"] = [stat(np.asarray(sa), np.asarray(sb)) for sa, sb in strata]
    spin = sum(sum(lp.spin_s) for lp in loops[(arm_a, c)])
    out["injected_pct"] = 100.0 * spin / float(a.sum()) if spin else 0.0
    return out


def check_share(loops: list[DecodeLoop]) -> dict[str, float]:
    """The check's own seconds over the decode steps' seconds (percent), and its median per call."""
    checks = [s for lp in loops for s in lp.check_s]
    steps = sum(dt for lp in loops for dt, _ in lp.decode_steps)
    return {"share_pct": 100.0 * sum(checks) / steps if steps else float("nan"),
            "median_us": 1e6 * statistics.median(checks) if checks else float("nan")}


def ci_width(cmp: dict[str, dict[int, dict[str, object]]]) -> float:
    """The widest 95% interval (points) over every comparison, concurrency and figure."""
    return max(hi - lo for per_c in cmp.values() for r in per_c.values()
               for lo, hi in (r["throughput_ci95"], r["p95_ci95"]))


# ---------------------------------------------------------------- command

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype")
    p.add_argument("--concurrency", default=None, help="comma-separated (default 8,32,64; quick 8,16)")
    p.add_argument("--repeats", type=int, default=None, help="at least this many repetitions (default 3; quick 2)")
    p.add_argument("--max-repeats", type=int, default=None, help="at most (default 8; quick 4)")
    p.add_argument("--ci-width", type=float, default=1.0,
                   help="stop repeating once every 95%% interval is narrower than this many points (default 1)")
    p.add_argument("--inject-pct", type=float, default=1.0,
                   help="the calibration arm's busy-wait in the check path, %% of its step (0: no such arm)")
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
    min_repeats = args.repeats or (2 if quick else 3)
    max_repeats = max(min_repeats, args.max_repeats or (4 if quick else 8))
    prompt_tokens = args.prompt_tokens or (48 if quick else 64)  # the chat template takes 30
    output_tokens = args.output_tokens or (32 if quick else 64)
    inject = args.inject_pct / 100.0
    if args.threads:
        torch.set_num_threads(args.threads)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    started = time.perf_counter()

    model_dir = resolve_model(args.model)
    tok = Tokenizer.from_model_dir(model_dir)
    model = LlamaModel.from_pretrained(model_dir, DTYPES[args.dtype], EngineConfig().gemm_buckets)
    prompts = fixed_length_prompts(tok, max(points), prompt_tokens)
    arms = {name: check for name, check in ARMS.items() if inject > 0 or name != "on+inject"}
    comparisons = {k: v for k, v in COMPARISONS.items() if v[0] in arms}
    engines = {name: LLMEngine(model, EngineConfig(dtype=args.dtype, kv_format="fp8_e4m3", integrity_check=check,
                                                   page_size=args.page_size, max_num_seqs=max(points)), tok)
               for name, check in arms.items()}
    timers = {name: CheckTimer(e) for name, e in engines.items() if arms[name]}

    def loop(name: str, c: int, requests: int, out: int) -> DecodeLoop:
        return DecodeLoop(engines[name], name, prompts, c, requests, out, timer=timers.get(name),
                          inject=inject if name == "on+inject" else 0.0)

    step_in_turn([loop(name, 2, 2, 4) for name in engines])  # warm-up
    loops: dict[tuple[str, int], list[DecodeLoop]] = {(name, c): [] for name in engines for c in points}
    rows: list[DecodeRow] = []
    cmp: dict[str, dict[int, dict[str, object]]] = {}
    rep = 0
    while rep < max_repeats:
        for c in points:
            these = [loop(name, c, c, output_tokens) for name in engines]
            step_in_turn(rotated(these, rep))
            for lp in these:
                loops[(lp.kv, c)].append(lp)
                rows.append(row := lp.decode_row(rep))
                log(f"rep {rep} c={c:<3} {row.setting:<9}: {row.decode_tok_s:7.1f} decode tok/s, "
                    f"TPOT p95 {1e3 * row.tpot_p95_s:6.1f} ms, {row.decode_steps} decode steps, {row.wall_s:.1f} s")
        rep += 1
        cmp = {k: {c: compare(loops, a, b, c) for c in points} for k, (a, b) in comparisons.items()}
        width = ci_width(cmp)
        log(f"after {rep} repetitions: widest 95% interval {width:.2f} points")
        if rep >= min_repeats and width <= args.ci_width:
            break
    stats = {name: {k: v for k, v in e.snapshot().items() if k.startswith("integrity")} for name, e in engines.items()}
    if stats["on"]["integrity_checks"] == 0 or stats["off"]["integrity_checks"] != 0:
        log(f"warning: the check did not run as configured: {stats}")
    share = {c: check_share(loops[("on", c)]) for c in points}
    targets, detected = _verdicts(cmp, points)
    total_s = time.perf_counter() - started
    _print(args, cmp, share, rows, points, rep, prompt_tokens, output_tokens, targets, detected, stats, total_s)

    worst = lambda key: max(cmp["check"][c][key] for c in points)  # noqa: E731
    report = {
        "model": args.model, "dtype": args.dtype, "threads": torch.get_num_threads(), "quick": quick,
        "config": {"kv_format": "fp8_e4m3", "concurrency": points, "repeats": rep, "min_repeats": min_repeats,
                   "max_repeats": max_repeats, "ci_width": args.ci_width, "inject_pct": args.inject_pct,
                   "prompt_tokens": prompt_tokens, "output_tokens": output_tokens, "page_size": args.page_size,
                   "max_num_seqs": max(points), "arms": list(arms),
                   "measured": "decode steps only, own clocks, stepped in turn (rotated order), paired by step; "
                               "95% CI: stratified circular block bootstrap (blocks of 4 steps, 2000 resamples)"},
        "headline": {"throughput_overhead_pct_max": worst("throughput_pct"), "p95_overhead_pct_max": worst("p95_pct"),
                     "check_share_pct_max": max(s["share_pct"] for s in share.values()),
                     "one_pct_detected": detected},
        "overhead_throughput_pct": {str(c): cmp["check"][c]["throughput_pct"] for c in points},
        "overhead_p95_pct": {str(c): cmp["check"][c]["p95_pct"] for c in points},
        "comparisons": {k: {str(c): v for c, v in per_c.items()} for k, per_c in cmp.items()},
        "check_share": {str(c): v for c, v in share.items()},
        "spread": {f"{fig}_pct": {str(c): spread(cmp["check"][c][f"{fig}_per_repeat"])
                                  | {"per_repeat": cmp["check"][c][f"{fig}_per_repeat"]} for c in points}
                   for fig in ("throughput", "p95")},
        "targets": targets,
        "rows": [asdict(r) for r in rows],
        "decode_step_s": {arm: {str(c): [[dt for dt, _ in lp.decode_steps] for lp in loops[(arm, c)]] for c in points}
                          for arm in engines},
        "check_s": {arm: {str(c): [lp.check_s for lp in loops[(arm, c)]] for c in points} for arm in timers},
        "engine_stats": stats,
        "total_s": total_s,
    }
    write_report(args.json_path, report)
    return 0


def _verdicts(cmp: dict[str, dict[int, dict[str, object]]], points: list[int]) -> tuple[dict[str, bool], bool | None]:
    """Targets (met when every level's interval lies under 1%) and whether the calibration arm's known
    cost was detected at every level (its interval excludes 0 and holds the injected share)."""
    targets = {f"{fig}_overhead_lt_1pct": all(cmp["check"][c][f"{fig}_ci95"][1] < 1.0 for c in points)
               for fig in ("throughput", "p95")}
    if "inject" not in cmp:
        return targets, None
    detected = all(r["throughput_ci95"][0] > 0 and r["throughput_ci95"][0] <= r["injected_pct"]
                   <= r["throughput_ci95"][1] for r in cmp["inject"].values())
    return targets, detected


def _print(args, cmp, share, rows, points, repeats, prompt_tokens, output_tokens, targets, detected, stats,
           total_s) -> None:
    med = lambda arm, c, field: statistics.median(  # noqa: E731
        getattr(r, field) for r in rows if r.setting == arm and r.concurrency == c)
    fmt = lambda r, key: f"{r[key + '_pct']:+6.2f} [{r[key + '_ci95'][0]:+.2f}, {r[key + '_ci95'][1]:+.2f}]"  # noqa: E731
    print(f"\nedgeserve bench integrity  model={args.model} dtype={args.dtype} kv=fp8_e4m3 "
          f"threads={torch.get_num_threads()}{' (quick)' if args.quick else ''}")
    print(f"{prompt_tokens} prompt + {output_tokens} output tokens per request, one wave of c requests, {repeats} "
          f"repetitions, decode steps only, paired by step; overhead % [95% CI]")
    print(f"{'conc':>5}{'tok/s off':>10}{'tok/s on':>9}{'throughput overhead':>25}{'p95 ms off':>11}{'p95 ms on':>10}"
          f"{'p95 overhead':>25}{'check share':>13}")
    for c in points:
        r = cmp["check"][c]
        print(f"{c:>5}{med('off', c, 'decode_tok_s'):>10.1f}{med('on', c, 'decode_tok_s'):>9.1f}"
              f"{fmt(r, 'throughput'):>25}{1e3 * med('off', c, 'tpot_p95_s'):>11.1f}"
              f"{1e3 * med('on', c, 'tpot_p95_s'):>10.1f}{fmt(r, 'p95'):>25}{share[c]['share_pct']:>12.3f}%")
    if "inject" in cmp:
        print(f"calibration: on+inject vs on, a busy-wait of {args.inject_pct:g}% of the step in the check path")
        for c in points:
            r = cmp["inject"][c]
            print(f"{c:>5}  injected {r['injected_pct']:.2f}%, measured throughput {fmt(r, 'throughput')}, "
                  f"p95 {fmt(r, 'p95')}")
        print(f"  known cost {'DETECTED at every level' if detected else 'NOT resolved: this run cannot tell 1%'}")
    print("targets: " + ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in targets.items())
          + " (met: the interval's upper end under 1%)")
    print(f"checks run: on {stats['on']['integrity_checks']}, off {stats['off']['integrity_checks']}; "
          f"aborts {stats['on']['integrity_aborts']}; took {total_s:.0f} s")
