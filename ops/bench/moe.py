"""MoE: one layer per expert path, and a random Glm4Moe model's decode and prefill with fp32 vs int4 experts.

Model: a random `Glm4MoeForCausalLM` folder written once per run into a temporary
directory (`write_random_glm4_moe`: tensor names and config.json from transformers,
one safetensors shard per layer, so memory holds one layer at a time). Defaults:
hidden 1024, 8 layers (the first dense, intermediate 2048; `first_k_dense_replace`
1, as GLM-4.5), 64 routed experts of intermediate 512, top-8, one shared expert,
8 groups with 4 kept, 8 query / 2 KV heads of 128, vocab 8192; `--quick` keeps the
dimensions and has 2 layers. Float32 compute and FP32 KV unless said otherwise, tokenizer-free (token ids).

1. **Layer** (`ops.bench.moe_layer.moe_layer_ms`): one MoE layer of the same
   config, median ms per path (`grouped`, `loop`, `int4_grouped`, `int4_loop`, `transformers`) at
   1, 8, 32 and 256 tokens, paths interleaved, 15 rounds (quick 3).
2. **Decode**: three engines, ``fp32``, ``bf16`` and ``int4`` (``prefill_weights =
   decode_weights``: every linear layer and expert in that format, the router gate
   float32 in all; ``bf16`` computes in bfloat16 over bf16 KV pages, the others in
   float32 over fp32 ones). At each c (1, 8, 32) all get the same c requests of P random
   prompt tokens + O outputs (P 64, quick 32; O 32 at c <= 8, 16 above, quick 8),
   all at once, greedy, EOS ignored, stepped in turn with the first mover alternating
   (`ops.bench.harness.loops.step_in_turn`); tok/s = c / median decode-step time
   (`DecodeLoop`: steps where every request already has a token).
3. **Prefill**: one prompt of 512 tokens (quick 128) as a single step, per engine
   in turn, R = 3 times (quick 1) after an untimed warm-up; tok/s = tokens / median.

Targets (this CPU): at 32 tokens the grouped layer >= 2x the loop and >= 1x
transformers; INT4 experts at c = 1 >= 1.5x fp32 experts. Speed-up = the slower
time over the faster, so > 1 means the first named is faster.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ops.bench.harness.loops import DecodeLoop, prefill_tok_s, step_in_turn
from ops.bench.harness.machine import load_average_text
from ops.bench.harness.progress import log
from ops.bench.harness.prompts import random_prompts
from ops.bench.moe_layer import LAYER_PATHS, hf_experts_implementation, moe_layer_ms
from ops.bench.report import provenance, write_report
from ops.cluster import machine_info

__all__ = ["add_arguments", "run", "model_config", "write_random_glm4_moe", "resident_mb", "ratios_and_targets",
           "format_table", "FORMATS", "LAYER_TOKENS"]

FORMATS = ("fp32", "bf16", "int4")  # engine weight formats compared (bf16: also the compute dtype; int4: g128)
LAYER_TOKENS = (1, 8, 32, 256)
TARGETS = {"grouped_vs_loop_32": 2.0, "grouped_vs_transformers_32": 1.0, "int4_vs_fp32_decode_c1": 1.5}


def model_config(hidden: int = 1024, layers: int = 8, experts: int = 64, top_k: int = 8, inter: int = 512,
                 vocab: int = 8192) -> dict[str, Any]:
    """`Glm4MoeConfig` keyword arguments of the benchmark model (see the module docstring)."""
    heads = max(1, hidden // 128)
    groups = 8 if experts % 8 == 0 and experts >= 16 else 1
    return dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=inter,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
                head_dim=hidden // heads, n_routed_experts=experts, num_experts_per_tok=top_k, n_shared_experts=1,
                n_group=groups, topk_group=max(1, groups // 2), first_k_dense_replace=1 if layers > 1 else 0,
                norm_topk_prob=True, routed_scaling_factor=2.5, use_qk_norm=False, attention_bias=False,
                max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1,
                eos_token_id=2, num_nextn_predict_layers=0, architectures=["Glm4MoeForCausalLM"])


def _random_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Norm weights 1 + N(0, 0.1); correction bias U[0, 0.01); matrices N(0, fan_in^-1) (fan_in = last dim)."""
    if name.endswith("e_score_correction_bias"):
        return torch.rand(shape, generator=gen) * 0.01
    if "norm" in name or len(shape) == 1:
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    return torch.randn(shape, generator=gen).mul_(shape[-1] ** -0.5)


def write_random_glm4_moe(path: Path, cfg_kwargs: dict[str, Any], seed: int = 0) -> Path:
    """Write a random float32 Glm4Moe checkpoint to `path`: config.json from `Glm4MoeConfig(**cfg_kwargs)`,
    the tensor names and shapes transformers' `Glm4MoeForCausalLM` has (built on the meta device, so
    nothing is allocated), one safetensors shard per decoder layer plus one for the rest, and
    model.safetensors.index.json. Peak memory is one layer's tensors."""
    import transformers
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = transformers.Glm4MoeConfig(**cfg_kwargs)
    with torch.device("meta"):
        specs = {n: tuple(t.shape) for n, t in transformers.Glm4MoeForCausalLM(cfg).state_dict().items()}
    shards: dict[str, list[str]] = {}
    for name in specs:
        parts = name.split(".")
        key = f"layer{int(parts[2]):03d}" if name.startswith("model.layers.") else "rest"
        shards.setdefault(key, []).append(name)
    gen = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    for i, key in enumerate(sorted(shards)):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: _random_tensor(n, specs[n], gen) for n in shards[key]}, path / file, metadata={"format": "pt"})
        weight_map.update({n: file for n in shards[key]})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    cfg.save_pretrained(path)
    return path


def resident_mb() -> dict[str, float]:
    """This process's resident memory now (MB): ``anon`` (heap: weights, KV) and ``file`` (mapped
    file pages, e.g. a checkpoint still memory-mapped: clean, so the kernel can drop them)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {key: int(fields[f"Rss{key.capitalize()}"].split()[0]) / 1024 for key in ("anon", "file")
            if f"Rss{key.capitalize()}" in fields}


def ratios_and_targets(layer_ms: dict[str, dict[str, float]], decode: dict[str, dict[str, float]],
                       tokens: str = "32", c: str = "1") -> tuple[dict[str, float | None], dict[str, bool]]:
    """Speed-ups behind the targets and whether each is met (a missing path's ratio is None, not met).

    layer_ms {path: {tokens: ms}}, decode {format: {c: tok/s}}, keys as strings."""
    def speedup(slow: str, fast: str) -> float | None:
        if tokens not in layer_ms.get(slow, {}) or tokens not in layer_ms.get(fast, {}):
            return None
        return layer_ms[slow][tokens] / layer_ms[fast][tokens]

    ratios: dict[str, float | None] = {
        f"grouped_vs_loop_{tokens}": speedup("loop", "grouped"),
        f"grouped_vs_transformers_{tokens}": speedup("transformers", "grouped"),
        f"int4_loop_vs_loop_{tokens}": speedup("loop", "int4_loop"),
        f"int4_grouped_vs_int4_loop_{tokens}": speedup("int4_loop", "int4_grouped"),
        f"int4_vs_fp32_decode_c{c}": (decode["int4"][c] / decode["fp32"][c]
                                      if c in decode.get("int4", {}) and c in decode.get("fp32", {}) else None),
    }
    if c in decode.get("bf16", {}) and c in decode.get("fp32", {}):  # no target: how the bf16 engine fares
        ratios[f"bf16_vs_fp32_decode_c{c}"] = decode["bf16"][c] / decode["fp32"][c]
    targets = {f"{name}_ge_{bound:g}x": ratios.get(name) is not None and ratios[name] >= bound
               for name, bound in TARGETS.items() if name in ratios}
    return ratios, targets


def format_table(report: dict[str, Any]) -> str:
    """The printed summary of a report (the JSON's figures, ratios and targets)."""
    cfg, m = report["config"], report["machine"]
    model = cfg["model"]
    lines = [f"edgeserve bench moe{' (quick)' if report['quick'] else ''}: random Glm4Moe, hidden "
             f"{model['hidden_size']}, {model['num_hidden_layers']} layers ({model['first_k_dense_replace']} dense), "
             f"{model['n_routed_experts']} experts of {model['moe_intermediate_size']}, "
             f"top-{model['num_experts_per_tok']}, {model['n_shared_experts']} shared, vocab {model['vocab_size']}; "
             f"float32, threads {report['threads']}",
             f"machine: {m['cpu_model']}, {m['cpus_usable']}/{m['cpu_count']} CPUs, "
             f"{' '.join(f for f in m['cpu_flags'] if f.startswith(('avx512', 'amx')) or f == 'avx2')}; load "
             f"{' '.join(report['load_avg_before'])} -> {' '.join(report['load_avg_after'])}", "",
             f"MoE layer ms (median of {cfg['layer_reps']} interleaved rounds; transformers' experts: "
             f"{cfg['transformers_experts_implementation']})",
             f"{'path':<14}" + "".join(f"{t:>9}" for t in cfg["layer_tokens"])]
    for path, row in report["moe_layer_ms"].items():
        lines.append(f"{path:<14}" + "".join(f"{row[str(t)]:>9.2f}" for t in cfg["layer_tokens"]))
    dec = report["decode_tok_s"]
    lines += ["", f"decode tok/s ({cfg['prompt_tokens']}-token prompts, median decode step)",
              f"{'c':>4}" + "".join(f"{f:>9}" for f in dec) + f"{'int4/fp32':>11}"]
    for c in map(str, cfg["concurrency"]):
        lines.append(f"{c:>4}" + "".join(f"{dec[f][c]:>9.1f}" for f in dec)
                     + f"{dec['int4'][c] / dec['fp32'][c]:>10.2f}x")
    lines += ["", f"prefill tok/s ({cfg['prefill_tokens']}-token prompt, one step, median of "
              f"{cfg['prefill_repeats']}): " + ", ".join(f"{f} {v:.0f}" for f, v in report["prefill_tok_s"].items()),
              "weights held: " + ", ".join(f"{f} {b / 1e9:.2f} GB" for f, b in report["weight_memory_bytes"].items())
              + "; resident after loading all: " + ", ".join(f"{k} {v / 1024:.1f} GB"
                                                              for k, v in report["resident_mb_after_load"].items()),
              "", "ratios: " + ", ".join(f"{k} {'n/a' if v is None else f'{v:.2f}x'}"
                                         for k, v in report["ratios"].items()),
              "targets: " + ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in report["targets"].items())]
    return "\n".join(lines)


# ---------------------------------------------------------------- command

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 8; quick 2)")
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--inter", type=int, default=512, help="moe_intermediate_size")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--layer-tokens", default=",".join(map(str, LAYER_TOKENS)))
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--prompt-tokens", type=int, default=None, help="P for decode (default 64; quick 32)")
    p.add_argument("--prefill-tokens", type=int, default=None, help="prefill prompt length (default 512; quick 128)")
    p.add_argument("--threads", type=int, default=None)


def _output_tokens(c: int, quick: bool) -> int:
    return 8 if quick else (32 if c <= 8 else 16)


def run(args: argparse.Namespace) -> int:
    import transformers

    from backend.config import load_config
    from backend.engine import EngineConfig, LLMEngine
    from backend.kv_cache import kv_bytes_per_token

    quick = args.quick
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    load_before = load_average_text()
    cfg_kwargs = model_config(args.hidden, args.layers or (2 if quick else 8), args.experts, args.top_k, args.inter,
                              args.vocab)
    layer_tokens = [int(t) for t in args.layer_tokens.split(",")]
    points = [int(c) for c in args.concurrency.split(",")]
    prompt_tokens = args.prompt_tokens or (32 if quick else 64)
    prefill_tokens = args.prefill_tokens or (128 if quick else 512)
    layer_reps, prefill_repeats = (3, 1) if quick else (15, 3)
    timings: dict[str, float] = {}

    # -- 1. one MoE layer per path
    t = time.perf_counter()
    hf_cfg = transformers.Glm4MoeConfig(**cfg_kwargs)
    layer = moe_layer_ms(hf_cfg, layer_tokens, layer_reps)
    layer_ms = {path: {str(n): ms for n, ms in layer[path].items()} for path in LAYER_PATHS if path in layer}
    timings["layer_s"] = time.perf_counter() - t
    log(f"layer: {timings['layer_s']:.0f} s")

    with tempfile.TemporaryDirectory(prefix="bench-moe-") as tmp:
        t = time.perf_counter()
        model_dir = write_random_glm4_moe(Path(tmp), cfg_kwargs)
        timings["write_model_s"] = time.perf_counter() - t
        max_c = max(points)
        kv_tokens = max(max_c * (prompt_tokens + _output_tokens(max_c, quick)), prefill_tokens) + 32 * max_c
        engine_cfg = dict(dtype="float32", kv_format="fp32", kv_cache_bytes=kv_tokens * kv_bytes_per_token(
            load_config(model_dir), "fp32"), max_num_seqs=max_c, max_num_batched_tokens=max(512, prefill_tokens),
            prefill_chunk_size=max(512, prefill_tokens), max_model_len=prefill_tokens + 64)
        engines: dict[str, LLMEngine] = {}
        for fmt in FORMATS:
            t = time.perf_counter()
            compute = dict(dtype="bfloat16", kv_format="bf16") if fmt == "bf16" else {}  # bf16 KV: fewer bytes
            engines[fmt] = LLMEngine.from_pretrained(model_dir, EngineConfig(prefill_weights=fmt, decode_weights=fmt,
                                                                             **{**engine_cfg, **compute}))
            timings[f"load_{fmt}_s"] = time.perf_counter() - t
            log(f"loaded {fmt} in {timings[f'load_{fmt}_s']:.1f} s")
        rss = resident_mb()  # every engine held: the run's high point

    # -- 2. decode, the formats stepped in turn
    t = time.perf_counter()
    prompts = random_prompts(cfg_kwargs["vocab_size"], max_c, prompt_tokens)
    step_in_turn([DecodeLoop(e, fmt, prompts, 2, 2, 4) for fmt, e in engines.items()])  # warm-up
    decode: dict[str, dict[str, float]] = {fmt: {} for fmt in engines}
    for c in points:
        loops = [DecodeLoop(e, fmt, prompts, c, c, _output_tokens(c, quick)) for fmt, e in engines.items()]
        step_in_turn(loops)
        for loop in loops:
            decode[loop.kv][str(c)] = loop.median_tok_s()
        log(f"decode c={c}: " + ", ".join(f"{fmt} {decode[fmt][str(c)]:.1f}" for fmt in engines) + " tok/s")
    del loops  # they hold the engines
    timings["decode_s"] = time.perf_counter() - t

    # -- 3. prefill
    t = time.perf_counter()
    prefill = prefill_tok_s(engines, random_prompts(cfg_kwargs["vocab_size"], 1, prefill_tokens, seed=1)[0],
                            prefill_repeats)
    timings["prefill_s"] = time.perf_counter() - t
    memory = {fmt: e.model.weight_memory()["total"] for fmt, e in engines.items()}
    del engines
    timings["total_s"] = time.perf_counter() - started
    load_after = load_average_text()

    ratios, targets = ratios_and_targets(layer_ms, decode)
    report = {
        **provenance(), "quick": quick, "threads": torch.get_num_threads(), "machine": machine_info(),
        "load_avg_before": load_before, "load_avg_after": load_after,
        "config": {"model": cfg_kwargs, "layer_tokens": layer_tokens, "layer_reps": layer_reps,
                   "transformers_experts_implementation": hf_experts_implementation(hf_cfg),
                   "concurrency": points, "prompt_tokens": prompt_tokens,
                   "output_tokens": {str(c): _output_tokens(c, quick) for c in points},
                   "prefill_tokens": prefill_tokens, "prefill_repeats": prefill_repeats, "int4_group_size": 128},
        "moe_layer_ms": layer_ms, "decode_tok_s": decode, "prefill_tok_s": prefill,
        "weight_memory_bytes": memory, "resident_mb_after_load": rss, "ratios": ratios, "targets": targets,
        "timings_s": timings,
    }
    print("\n" + format_table(report) + f"\ntook {timings['total_s']:.0f} s")
    write_report(args.json_path, report)
    return 0
