"""Tensor parallelism on this CPU: per-rank weight bytes, decode step time and collectives at TP 1 vs TP 3.

Model: SmolLM2-135M-Instruct when it is pulled (9 query / 3 KV heads: it splits 3 ways,
not 2), else a random 30-layer Llama of the same shape written by `transformers` (no
download). Float32 compute, FP32 KV, no MKL packs (`gemm_buckets` none: the packs would
multiply every rank's memory), `--threads` torch threads per rank (default 1).

Per TP degree (1, then 3: spawned ranks over gloo on 127.0.0.1, this process rank 0):
1. **rank weight bytes**: per rank, the checkpoint bytes it read (its slices only) and
   the weight bytes it holds (float32 after conversion from the stored bf16);
2. **decode step ms** at c = 1 and 32: c requests of 32 random prompt tokens, greedy,
   EOS ignored, O = 24 outputs (quick 6); the median wall time of the steps where every
   request is decoding;
3. **collectives per step**: calls and bytes rank 0 sent into them, per decode step (by kind:
   one step broadcast pair, 2 L + 1 all-reduces, one logits gather).

Two cores cannot make TP faster here: the figures show the overhead of the collectives and
the memory split, which is what TP buys on devices that each hold 1/N of a model.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from ops.bench.report import write_report

__all__ = ["add_arguments", "run", "measure_tp", "bench_model"]

DEGREES = (1, 3)
CONCURRENCY = (1, 32)
PROMPT_TOKENS = 32


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m",
                   help="model folder or name (default SmolLM2-135M when pulled, else a random Llama of its shape)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--degrees", default=",".join(map(str, DEGREES)), help="TP degrees to run (comma separated)")


def bench_model(name: str, scratch: Path) -> tuple[Path, str]:
    """(model folder, description): `name` if it resolves without a download, else a random Llama of
    SmolLM2-135M's shape (30 layers, hidden 576, 9/3 heads, vocab 49152) written to `scratch`."""
    from backend.errors import EdgeServeError
    from ops.pull import resolve_model

    try:
        return resolve_model(name, progress=False), name
    except EdgeServeError as exc:
        print(f"{name} unavailable ({exc}); using a random Llama of SmolLM2-135M's shape")
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                                   tie_word_embeddings=True)
    path = scratch / "random-llama"
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(path, safe_serialization=True)
    return path, "random Llama (SmolLM2-135M shape)"


def _decode_ms(engine: Any, c: int, outputs: int, seed: int) -> tuple[float, int, dict[str, Counter]]:
    """Median decode-step ms with c requests in flight, the decode steps timed, and the collectives
    rank 0 made in them (calls and bytes by kind; empty at TP 1)."""
    from backend.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(seed)
    vocab = engine.model.cfg.vocab_size
    seqs = [engine.add_request(torch.randint(0, vocab, (PROMPT_TOKENS,), generator=g).tolist(),
                               SamplingParams(max_tokens=outputs, temperature=0.0, ignore_eos=True)) for _ in range(c)]
    group = engine.group
    times: list[float] = []
    calls: Counter = Counter()
    sent: Counter = Counter()
    while engine.has_work():
        decoding = all(s.output_ids for s in seqs)  # every request past its prompt: a pure decode step
        before = (Counter(group.calls), Counter(group.bytes)) if group is not None else None
        t0 = time.perf_counter()
        engine.step()
        if decoding:
            times.append(time.perf_counter() - t0)
            if before is not None:
                calls.update(Counter(group.calls) - before[0])
                sent.update(Counter(group.bytes) - before[1])
    return 1000 * statistics.median(times), len(times), {"calls": calls, "bytes": sent}


def measure_tp(model_dir: Path, tp: int, threads: int, outputs: int) -> dict[str, Any]:
    """One TP degree's figures (see the module docstring)."""
    from backend.distributed.group import GroupSpec, start_group
    from backend.engine import EngineConfig, LLMEngine

    config = EngineConfig(dtype="float32", kv_format="fp32", kv_cache_bytes=64 * 2**20, gemm_buckets=(),
                          num_threads=threads, max_num_seqs=64, tensor_parallel=tp)
    torch.set_num_threads(threads)
    group = start_group(GroupSpec(tp, str(model_dir), config, timeout_s=120)) if tp > 1 else None
    try:
        engine = LLMEngine.from_pretrained(model_dir, config, group.coll if group is not None else None)
        if group is not None:
            weights = group.coll.rank_weights
        else:
            memory = engine.model.weight_memory()
            weights = [{"bytes_read": engine.model.bytes_read, "bytes_held": memory["total"] - memory["packs"]}]
        _decode_ms(engine, 2, 2, seed=99)  # warm-up
        step_ms, per_step = {}, {}
        for c in CONCURRENCY:
            ms, steps, coll = _decode_ms(engine, c, outputs, seed=c)
            step_ms[c] = round(ms, 3)
            per_step[c] = {"steps": steps, "calls": {k: v / steps for k, v in coll["calls"].items()},
                           "bytes": {k: v / steps for k, v in coll["bytes"].items()}}
        return {"rank_weights": weights, "step_ms": step_ms, "collectives": per_step}
    finally:
        if group is not None:
            group.shutdown()


def _table(results: dict[int, dict[str, Any]]) -> str:
    lines = ["| TP | rank | bytes read | bytes held | step ms c=1 | step ms c=32 | collectives / step "
             "| bytes / step (c=1, c=32) |",
             "|---|---|---|---|---|---|---|---|"]
    for tp, r in results.items():
        calls = sum(r["collectives"][1]["calls"].values())
        b = [sum(r["collectives"][c]["bytes"].values()) for c in CONCURRENCY]
        for rank, w in enumerate(r["rank_weights"]):
            first = rank == 0
            lines.append(f"| {tp} | {rank} | {w['bytes_read'] / 1e6:.1f} MB | {w['bytes_held'] / 1e6:.1f} MB | "
                         + (f"{r['step_ms'][1]:.1f} | {r['step_ms'][32]:.1f} | {calls:.0f} | "
                            f"{b[0] / 1e3:.1f} kB, {b[1] / 1e3:.1f} kB |" if first else " | | | |"))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    degrees = [int(x) for x in str(args.degrees).split(",")]
    outputs = 6 if args.quick else 24
    with tempfile.TemporaryDirectory(prefix="edgeserve-bench-tp-") as scratch:
        model_dir, described = bench_model(args.model, Path(scratch))
        results = {tp: measure_tp(model_dir, tp, args.threads, outputs) for tp in degrees}
    print(f"model: {described}, {args.threads} thread(s) per rank, {outputs} outputs per request")
    print(_table(results))
    report = {
        "model": described, "threads_per_rank": args.threads, "outputs": outputs, "prompt_tokens": PROMPT_TOKENS,
        "rank_weight_bytes": {tp: [w["bytes_read"] for w in r["rank_weights"]] for tp, r in results.items()},
        "rank_weight_bytes_held": {tp: [w["bytes_held"] for w in r["rank_weights"]] for tp, r in results.items()},
        "step_ms": {tp: r["step_ms"] for tp, r in results.items()},
        "collectives_per_step": {tp: {c: sum(r["collectives"][c]["calls"].values()) for c in CONCURRENCY}
                                 for tp, r in results.items()},
        "collective_bytes_per_step": {tp: {c: sum(r["collectives"][c]["bytes"].values()) for c in CONCURRENCY}
                                      for tp, r in results.items()},
        "collectives_by_kind": {tp: r["collectives"] for tp, r in results.items()},
    }
    write_report(args.json_path, report)
    return 0
