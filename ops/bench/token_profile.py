"""Where one decode token's time goes inside the engine, at concurrency c (default 1).

One engine in process (the worker's own code, `serve`'s defaults: `--dtype auto` and
its KV format, or the given ones) decodes c requests of 80 prompt tokens (`--prompt-tokens`: the
context the decode steps attend to grows from there); after a
warm-up, every decode step of a measured window is timed (wall clock) and profiled,
and the step's time is split into:

- ``linear``: the GEMMs of the linear layers and the LM head (`aten::mm`, `addmm`,
  MKL's packed `_mkl_linear`, the INT4 `_weight_int4pack_mm_for_cpu`), self time from
  `torch.profiler`;
  plus the C decode GEMVs (`kernels.cpu_gemv.gemv_bf16`, `kernels.cpu_gemv_f32.gemv_f32`,
  `kernels.cpu_gemv_int4.gemv_int4`: ctypes calls the profiler cannot see, timed by wrapping them;
  ``gemv`` (bfloat16 and float32) and ``gemv_int4`` in the JSON are those parts alone);
- ``attention``: the paged decode attention call (also a ctypes call, so the bench wraps
  `backend.attention.paged_decode_attention_cpu` with a timer; its torch fallback, when it
  runs, is in ``other_ops``);
- ``other_ops``: every other torch op's self time (RoPE, residual adds, embedding, casts)
  and the wrapped wall time of the other C kernels (RMSNorm, SwiGLU, KV stores, argmax);
- ``python``: the rest of the step's wall time: the scheduler, input preparation,
  sampling bookkeeping, op dispatch from Python.

Both windows time steps of all c requests: their `max_tokens` covers what the first of them decode
while the others' prompts are still computed (`_prefill_steps_bound`; with long prompts that is
hundreds of tokens), and a measured step with fewer stops the run. Until 2026-12-07 it covered one
prefill chunk a step, which long prompts outran: at c = 32 and 1,000-token prompts requests finished
before and during the windows, so their steps held fewer than 32 (a plain step read 69 ms, a profiled
one after it 49).

``bound_ms`` is the time the step would take if it only streamed the weights once at
the read bandwidth measured in the same run (a large tensor sum): at c = 1 the linear
share against it says how close the GEMVs run to the memory system. The figures are
the profiled window's sums over its steps divided by the step count, so they add up
to ``step_ms``; a profiled step is slower than a plain one by the profiler's own cost,
reported as ``profiler_overhead`` (plain-step wall time vs profiled). The profiler's cost lands
in the wrapped C kernels' times too (their Python wrappers make torch ops: 1.3x the plain
window's time for the small ones at c = 1 and 32), so every C kernel is also timed over the
plain window, ``c_kernels_plain_ms`` (the wrappers' own cost there: under a microsecond a call).

Where a step runs every decoder layer in one C call (`backend/layers/fused_decode.py`: dense bfloat16
models, the default where the kernels build; ``--unfused`` runs the layers from Python instead), the
call times its own kernels (`cpu_decode_layers.TIMED_PARTS`) and those times go to the same
categories: its GEMVs to ``linear``, its attention to ``attention``, its RoPE, KV stores, norms and
SwiGLU to ``other_ops`` (``C fused ...``); ``fused_decode_steps`` counts the steps that took it.

End to end (gateway, worker HTTP, client) is `edgeserve bench e2e`'s business: its
in-process column is the worker's per-token time to set against this table.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import time
from collections import defaultdict
from typing import Any

import torch

from kernels.cpu_decode_layers import TIMED_PARTS
from ops.bench.harness.engines import add_engine_arguments, in_process_engine
from ops.bench.harness.progress import log
from ops.bench.report import write_report

__all__ = ["add_arguments", "run", "categorise"]

LINEAR_OPS = ("aten::mm", "aten::addmm", "mkl::_mkl_linear", "aten::_weight_int4pack_mm_for_cpu", "aten::bmm")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p)
    p.add_argument("--decode-weights", default=None, choices=["fp32", "bf16", "fp8", "int4"])
    p.add_argument("--int4-group-size", type=int, default=128)
    p.add_argument("--lm-head-weights", default=None, choices=["int8"],
                   help="int8: the LM head's 8-bit copy for steps of few rows (as serve's flag)")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--prompt-tokens", type=int, default=80,
                   help="prompt tokens of every request: the decode steps' context starts there")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores, as serve)")
    p.add_argument("--steps", type=int, default=None, help="decode steps measured (default 48; quick 16)")
    p.add_argument("--unfused", action="store_true",
                   help="run the decoder layers from Python (as EDGESERVE_FUSED_DECODE=0), not in one C call")


def categorise(self_us: dict[str, float], attention_us: float, wall_us: float, gemv_us: float = 0.0
               ) -> dict[str, float]:
    """Split `wall_us` into linear / attention / other_ops / python from per-op self times (µs) and the
    wall times of the C kernels the profiler cannot see (attention; the GEMVs: linear; the rest arrive in
    `self_us` as entries of their own: other_ops)."""
    linear = gemv_us + sum(v for k, v in self_us.items() if k in LINEAR_OPS)
    other = sum(v for k, v in self_us.items() if k not in LINEAR_OPS)
    python = max(0.0, wall_us - linear - other - attention_us)
    return {"linear": linear, "attention": attention_us, "other_ops": other, "python": python}


# the C kernels of a step besides the GEMVs and the attention, as the model's modules call them (ctypes calls the
# profiler cannot see: timed by wrapping, counted in other_ops, where the torch ops they replaced were)
_OTHER_C_KERNELS = (("backend.layers.norm", "rms_norm_bf16"), ("backend.layers.norm", "add_rms_norm_bf16"),
                    ("backend.rope", "rope_bf16"), ("backend.layers.swiglu", "silu_mul_bf16"),
                    ("backend.sampler", "argmax_rows"), ("backend.kv_cache", "store_kv_rows_cpu"),
                    ("backend.kv_cache", "store_kv_fp8_cpu"))


def _c_timers(stack: contextlib.ExitStack) -> dict[str, _CallTimer]:
    """Every C kernel of a step wrapped in a timer for the stack's life, by function name."""
    import backend.attention
    import kernels.cpu_gemv
    import kernels.cpu_gemv_f32
    import kernels.cpu_gemv_int4

    wrapped = [(backend.attention, "paged_decode_attention_cpu"), (kernels.cpu_gemv, "gemv_bf16"),
               (kernels.cpu_gemv_f32, "gemv_f32"), (kernels.cpu_gemv_int4, "gemv_int4"),
               *((importlib.import_module(m), name) for m, name in _OTHER_C_KERNELS)]
    return {name: stack.enter_context(_CallTimer(module, name)) for module, name in wrapped}


class _CallTimer:
    """Wraps `module.name` (a function the model looks up on its module at each call), summing its wall time."""

    def __init__(self, module: Any, name: str) -> None:
        self.module, self.name, self.inner, self.total_s = module, name, getattr(module, name), 0.0

    def __enter__(self) -> _CallTimer:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return self.inner(*args, **kwargs)
            finally:
                self.total_s += time.perf_counter() - t

        setattr(self.module, self.name, timed)
        return self

    def __exit__(self, *exc: object) -> None:
        setattr(self.module, self.name, self.inner)


class _FusedSeconds(dict):
    """Seconds per part (`cpu_decode_layers.TIMED_PARTS`) inside the fused decode call over a window: the C
    file times its kernel calls when asked (the profiler cannot see into it)."""

    def __init__(self, fused: Any) -> None:
        super().__init__()
        self.fused = fused

    def __enter__(self) -> _FusedSeconds:
        if self.fused is not None:
            self.fused.seconds = [0.0] * len(TIMED_PARTS)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fused is not None:
            self.update(zip(TIMED_PARTS, self.fused.seconds))
            self.fused.seconds = None


def _requests(engine: Any, c: int, n: int, seed: int, prompt_tokens: int = 80) -> None:
    from backend.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(seed)
    for _ in range(c):
        prompt = torch.randint(200, 40000, (prompt_tokens,), generator=g).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))


def _kv_bytes_per_token(args: argparse.Namespace) -> int:
    """An upper bound on one token's KV bytes over every layer for `args.model` (float32 rows, the largest format,
    and a quarter for the pages' slack): the pool `run` sizes holds every request's whole context."""
    from backend.config import load_config
    from backend.kv_cache import kv_bytes_per_token
    from ops.pull import resolve_model

    return int(kv_bytes_per_token(load_config(resolve_model(args.model)), "fp32") * 1.25)


def _prefill_steps_bound(c: int, prompt_tokens: int) -> int:
    """At most how many steps the engine takes to compute the c prompts (`EngineConfig`'s defaults), while the
    requests already prefilled decode in the same steps: the scheduler's limit on a step with c decode rows
    (`SchedulerConfig.step_limit`, under the C GEMV's mixed-step cap, assumed here whether or not this engine
    sets it) less those rows a step, plus a step a request for the chunks that end a prompt. At c = 32 and
    1,000-token prompts that is ~370 steps (measured: the first request had decoded ~290 tokens when the last
    prompt was done), where a budget of one `prefill_chunk_size` a step says 125."""
    from backend.engine import EngineConfig
    from backend.scheduler import SchedulerConfig
    from kernels import cpu_gemv

    cfg = SchedulerConfig(max_model_len=1, max_num_batched_tokens=max(EngineConfig().max_num_batched_tokens, c),
                          mixed_step_tokens=cpu_gemv.mixed_step_tokens() if cpu_gemv.available() else None)
    return -(-c * prompt_tokens // (cfg.step_limit(c) - c)) + c


def _decode_steps(engine: Any, steps: int, c: int) -> float:
    """Run `steps` steps (prefill first if pending); wall seconds of the decode steps only. Raises SystemExit
    when fewer than c requests ran in one of them: a window's steps must all be of the same batch."""
    total = 0.0
    done = 0
    phases = engine.model.steps_by_phase
    while done < steps and engine.has_work():
        before = phases["decode"]
        running = len(engine.scheduler.running)
        t = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t
        if phases["decode"] > before:
            if running < c:
                raise SystemExit(f"token-profile: a measured step ran {running} of the {c} requests (the others "
                                 f"had finished): the requests' max_tokens is too small for this prompt length")
            total += dt
            done += 1
    return total


def run(args: argparse.Namespace) -> int:
    from backend.cpu_features import cpu_flags
    from backend.layers.fused_decode import fused_layers
    from ops.bench.harness.machine import measure_machine

    if args.threads:
        torch.set_num_threads(args.threads)
    steps = args.steps or (16 if args.quick else 48)
    c = args.concurrency

    # tokens a request may generate: the warm-up, both windows and the steps of the prompts' prefill, in which the
    # requests already prefilled decode too
    n = 4 + 2 * steps + 8 + _prefill_steps_bound(c, args.prompt_tokens)
    tokens = args.prompt_tokens + n  # a request's context at its last step
    engine, dtype, kv = in_process_engine(args, kv_cache_bytes=max(1 << 29, c * tokens * _kv_bytes_per_token(args)),
                                          max_num_seqs=max(c, 1),
                                          decode_weights=args.decode_weights, int4_group_size=args.int4_group_size,
                                          lm_head_weights=args.lm_head_weights)
    machine = measure_machine(engine.model.dtype)
    decode_bytes = engine.model.decode_bytes(c)
    log(f"token-profile: {dtype}, kv {kv}, decode weights {args.decode_weights or 'as stored'}"
        f"{', LM head ' + args.lm_head_weights if args.lm_head_weights else ''} "
        f"({decode_bytes / 1e6:.0f} MB per step), c={c}, {torch.get_num_threads()} threads")

    engine.model.fused_decode = not args.unfused
    _requests(engine, c, n, seed=1, prompt_tokens=args.prompt_tokens)
    while engine.scheduler.queued_prefill_tokens():  # every prompt computed first: the windows time decode steps
        engine.step()
    _decode_steps(engine, 4, c)  # warm-up
    fused = fused_layers(engine.model, engine.cache)  # the layers' one C call, when the steps take it
    fused_before = engine.model.fused_steps
    from torch.profiler import ProfilerActivity, profile

    with contextlib.ExitStack() as stack:  # C kernels timed without the profiler, whose per-op cost inflates them
        plain_timers = _c_timers(stack)
        plain_fused = stack.enter_context(_FusedSeconds(fused))
        plain_s = _decode_steps(engine, steps, c)
    with contextlib.ExitStack() as stack:
        timers = _c_timers(stack)
        in_fused = stack.enter_context(_FusedSeconds(fused))
        prof = stack.enter_context(profile(activities=[ProfilerActivity.CPU]))
        profiled_s = _decode_steps(engine, steps, c)
    fused_steps = engine.model.fused_steps - fused_before
    self_us: dict[str, float] = defaultdict(float)
    for e in prof.key_averages():
        self_us[e.key] += e.self_cpu_time_total
    for _, name in _OTHER_C_KERNELS:
        self_us[f"C {name}"] = timers[name].total_s * 1e6
    for part in ("rope", "kv_store", "norms", "silu"):  # the fused call's row-wise kernels: other_ops, as above
        if in_fused.get(part):
            self_us[f"C fused {part}"] = in_fused[part] * 1e6
    attention, gemv_int4 = timers["paged_decode_attention_cpu"], timers["gemv_int4"]
    gemv_s = timers["gemv_bf16"].total_s + timers["gemv_f32"].total_s  # the bf16 or float32 GEMV's own calls
    split = categorise(self_us, (attention.total_s + in_fused.get("attention", 0.0)) * 1e6, profiled_s * 1e6,
                       (gemv_s + gemv_int4.total_s + in_fused.get("gemv", 0.0)) * 1e6)
    per_step = {k: v / steps / 1e3 for k, v in split.items()}  # ms
    step_ms = profiled_s / steps * 1e3
    bound_ms = decode_bytes / (machine["read_gb_s"] * 1e9) * 1e3
    top = sorted(((v, k) for k, v in self_us.items()), reverse=True)[:12]
    report = {
        "model": args.model, "dtype": dtype, "kv_format": kv, "decode_weights": args.decode_weights,
        "lm_head_weights": args.lm_head_weights,
        "lm_head_int8_max_rows": getattr(engine.model.lm_head, "max_rows", None),
        "concurrency": c, "prompt_tokens": args.prompt_tokens, "threads": torch.get_num_threads(), "steps": steps,
        "quick": args.quick,
        "cpu_flags_bf16": sorted(f for f in cpu_flags() if "bf16" in f or f.startswith("amx")),
        "machine": machine, "decode_weight_bytes": decode_bytes,
        "step_ms": step_ms, "plain_step_ms": plain_s / steps * 1e3, "profiler_overhead": profiled_s / plain_s,
        "per_step_ms": per_step, "share": {k: v / step_ms for k, v in per_step.items()},
        "bound_ms": bound_ms, "linear_vs_bound": per_step["linear"] / bound_ms,
        "gemv_ms": gemv_s / steps * 1e3, "gemv_int4_ms": gemv_int4.total_s / steps * 1e3,
        "fused_decode_steps": fused_steps, "fused_ms": {k: v / steps * 1e3 for k, v in in_fused.items()},
        "c_kernels_plain_ms": {**{k: t.total_s / steps * 1e3 for k, t in plain_timers.items()},
                               **{f"fused {k}": v / steps * 1e3 for k, v in plain_fused.items()}},
        "top_ops_ms_per_step": {k: v / steps / 1e3 for v, k in top},
    }
    report["headline"] = {"step_ms": round(step_ms, 2), **{f"{k}_share": round(v, 3) for k, v in
                                                             report["share"].items()},
                          "linear_vs_bound": round(report["linear_vs_bound"], 2)}
    print(f"\nedgeserve bench token-profile  {dtype}, kv {kv}, decode weights {args.decode_weights or 'as stored'}, "
          f"{'LM head ' + args.lm_head_weights + ', ' if args.lm_head_weights else ''}c={c}, "
          f"{args.prompt_tokens} prompt tokens, {torch.get_num_threads()} threads; {steps} steps")
    print(f"decoder layers: {'one fused C call' if fused_steps else 'called from Python'} "
          f"({fused_steps} of {2 * steps} measured steps fused)")
    print(f"step {step_ms:.2f} ms profiled ({report['plain_step_ms']:.2f} ms plain); weights read once at "
          f"{machine['read_gb_s']:.1f} GB/s: {bound_ms:.2f} ms")
    for k, v in per_step.items():
        print(f"  {k:<10} {v:8.2f} ms  {100 * v / step_ms:5.1f}%")
    print("C kernels without the profiler (ms per step): " + ", ".join(
        f"{k} {v:.2f}" for k, v in report["c_kernels_plain_ms"].items() if v > 0))
    print("top ops (self ms per step): " + ", ".join(f"{k} {v:.2f}" for k, v in
                                                     list(report["top_ops_ms_per_step"].items())[:6]))
    write_report(args.json_path, report)
    return 0
