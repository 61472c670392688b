"""Structured output: decode tok/s with and without a JSON-schema grammar, compile time, validity.

For each concurrency c (1, 8, 32) the same requests run free and under a JSON schema,
interleaved (free, schema, free, schema, ...), every request exactly `max_tokens` long
(free ones ignore EOS; the schema's array needs more items than fit, so EOS is never
allowed), and the median output tok/s of each is reported with the overhead. Grammar
compile time is measured per schema over generated schemas (a fresh cache each), and the
mask cost as the engine's `grammar_advance_s` per advance against the step time.
`valid_rate` is the share of finished outputs (over generated schemas) that validate;
outputs cut by `max_tokens` are counted apart (`cut`). Needs `jsonschema` (test extra).

JSON: {"tok_s": {"free": {c: ...}, "json_schema": {c: ...}}, "overhead_pct": {c: ...},
"compile_ms_p50", "mask_us_mean", "step_ms_mean", "valid_rate", "finished", "cut", ...}.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

import torch

from ops.bench.harness.progress import log
from ops.bench.report import provenance, write_report

__all__ = ["add_arguments", "run", "random_schema", "schemas"]

# never completes within max_tokens: at least 500 items
LONG_SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "minItems": 500, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                     "qty": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["name", "qty"], "additionalProperties": False}}}, "required": ["items"],
    "additionalProperties": False}


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """A small JSON schema: objects (required and optional keys), arrays, enums, nesting, bounded numbers."""
    kinds = ["integer", "number", "string", "enum", "boolean"] + (["object", "array"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 100)}
    if kind == "number":
        lo = rng.uniform(-10, 10)
        return {"type": "number", "minimum": round(lo, 2), "maximum": round(lo + rng.uniform(0.5, 20), 2)}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 6)}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "cyan", 1, 2.5, True, None], rng.randint(1, 4))}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": rng.randint(0, 1),
                "maxItems": rng.randint(1, 3)}
    keys = rng.sample(["id", "name", "tags", "size", "ok", "kind", "meta"], rng.randint(1, 3))
    return {"type": "object", "properties": {k: random_schema(rng, depth + 1) for k in keys},
            "required": rng.sample(keys, rng.randint(0, len(keys))), "additionalProperties": False}


def schemas(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """`n` generated schemas; every third an object wrapping one generated value under `answer`."""
    rng = random.Random(seed)
    return [{"type": "object", "properties": {"answer": random_schema(rng)}, "required": ["answer"],
             "additionalProperties": False} if i % 3 == 0 else random_schema(rng) for i in range(n)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--threads", type=int, default=None)


def _decode(engine, prompts: list[list[int]], params) -> tuple[float, int]:
    """Run every prompt at once (the engine batches up to max_num_seqs); (output tok/s, steps)."""
    seqs = [engine.add_request(p, params) for p in prompts]
    steps = 0
    t0 = time.perf_counter()
    while engine.has_work():
        engine.step()
        steps += 1
    wall = time.perf_counter() - t0
    return sum(len(s.output_ids) for s in seqs) / wall, steps


def run(args: argparse.Namespace) -> int:
    import jsonschema

    from backend.engine import EngineConfig, LLMEngine
    from backend.grammar import GrammarCompiler
    from backend.sampling_params import GrammarSpec, SamplingParams
    from ops.pull import resolve_model

    if args.threads:
        torch.set_num_threads(args.threads)
    levels = [int(c) for c in args.concurrency.split(",")]
    n_out, rounds, n_schemas = (16, 1, 12) if args.quick else (64, 3, 60)
    engine = LLMEngine.from_pretrained(resolve_model(args.model), EngineConfig(
        kv_cache_bytes=1 << 30, max_num_seqs=max(levels)))
    tok = engine.tokenizer
    chat = lambda text: tok.encode_chat([{"role": "user", "content": text}])  # noqa: E731
    spec = GrammarSpec("json_schema", json.dumps(LONG_SCHEMA))
    free_p = SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True)
    json_p = SamplingParams(max_tokens=n_out, temperature=0.0, grammar=spec)
    _decode(engine, [chat("warm up")], json_p)

    tok_s: dict[str, dict[str, float]] = {"free": {}, "json_schema": {}}
    mask_s = advances = 0.0
    step_s, steps_n = 0.0, 0
    for c in levels:
        prompts = [chat(f"List {i + 3} items you would pack for a trip, as JSON.") for i in range(c)]
        runs: dict[str, list[float]] = {"free": [], "json_schema": []}
        for _ in range(rounds):
            for name, params in (("free", free_p), ("json_schema", json_p)):
                a0, s0 = engine.stats["grammar_advances"], engine.stats["grammar_advance_s"]
                t0 = time.perf_counter()
                rate, steps = _decode(engine, prompts, params)
                if name == "json_schema":
                    advances += engine.stats["grammar_advances"] - a0
                    mask_s += engine.stats["grammar_advance_s"] - s0
                    step_s += time.perf_counter() - t0
                    steps_n += steps
                runs[name].append(rate)
        for name in runs:
            tok_s[name][str(c)] = statistics.median(runs[name])
        log(f"c={c}: free {tok_s['free'][str(c)]:.1f} tok/s, json_schema {tok_s['json_schema'][str(c)]:.1f} tok/s")

    generated = schemas(n_schemas, seed=1)
    compiler = GrammarCompiler(tok.backend_json(), engine.model.cfg.vocab_size, engine.eos_token_ids)
    for schema in generated:
        compiler.state(GrammarSpec("json_schema", json.dumps(schema)))
    compile_ms = statistics.median(compiler.compile_s) * 1e3
    valid = finished = cut = 0
    seqs = [(schema, engine.add_request(chat(f"Answer in JSON ({i})."), SamplingParams(
        max_tokens=128, temperature=0.0, grammar=GrammarSpec("json_schema", json.dumps(schema)))))
        for i, schema in enumerate(generated)]
    while engine.has_work():
        engine.step()
    for schema, s in seqs:
        if s.finish_reason != "stop":
            cut += 1
            continue
        finished += 1
        try:
            jsonschema.validate(json.loads(tok.decode(s.output_ids)), schema)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass

    overhead = {c: 100 * (1 - tok_s["json_schema"][c] / tok_s["free"][c]) for c in tok_s["free"]}
    report = {
        "model": args.model, "threads": torch.get_num_threads(), "quick": args.quick, "max_tokens": n_out,
        "rounds": rounds, "tok_s": tok_s, "overhead_pct": overhead, "compile_ms_p50": compile_ms,
        "mask_us_mean": 1e6 * mask_s / max(advances, 1), "step_ms_mean": 1e3 * step_s / max(steps_n, 1),
        "valid_rate": valid / finished if finished else 0.0, "finished": finished, "cut": cut,
        "schemas": len(generated), "target": {"overhead_pct_max": 10, "valid_rate": 1.0},
        "targets_met": all(v <= 10 for v in overhead.values()) and finished > 0 and valid == finished,
        "provenance": provenance(),
    }
    print(f"\nedgeserve bench structured  model={args.model} threads={torch.get_num_threads()}"
          f"{' (quick)' if args.quick else ''}")
    print(f"{'conc':>5}{'free tok/s':>12}{'schema tok/s':>14}{'overhead':>10}")
    for c in tok_s["free"]:
        print(f"{c:>5}{tok_s['free'][c]:>12.1f}{tok_s['json_schema'][c]:>14.1f}{overhead[c]:>9.1f}%")
    print(f"compile p50 {compile_ms:.2f} ms; mask+advance {report['mask_us_mean']:.0f} us per request-step "
          f"vs step {report['step_ms_mean']:.1f} ms; valid {valid}/{finished} finished ({cut} cut)")
    write_report(args.json_path, report)
    return 0
