"""The engine on a GPU end to end: step 6 of `ops/gpu_check.sh`, one JSON report (`--json`).

A lent GPU machine reaches no model hub and takes at most 64 MiB of carried files, so unless a
model is given (`--model`) or SmolLM2-135M is pulled there, the model is SmolLM2-135M's own config
and tokenizer (`--skeleton`, a few MB, written by `python -m ops.gpu_engine_check --write-skeleton
DIR` where the model is pulled) with random bfloat16 weights (`random_checkpoint`): the shapes,
kernels and serving path are SmolLM2's, the text is noise. Four parts, each recorded on its own
(a part that fails records its error and the next one runs):

- **parity**: greedy tokens of 4 prompts x 32 tokens from the engine on the device in float32
  (fp32 KV pages) against the engine on the CPU in float32: equal token for token, else the
  first position where each prompt's tokens part; and the same on the device with decode graphs
  (`EngineConfig.cuda_graphs`) against the device without them (`graphs_equal`).
- **served**: `edgeserve up --device D --dtype bfloat16 --kv-format fp8_e4m3 --decode-weights int4`
  streams one chat completion through the gateway (SSE chunks, `[DONE]`, a finish reason).
- **decode**: decode tok/s in process at c = 1 and 32 (closed loops, 64-token prompts, 128 output
  tokens), bf16 weights and KV against fp8 KV pages with INT4 decode weights, each eager and with
  decode graphs, the four engines stepped in turn (`ops.bench.harness.loops`), `--rounds` rounds.
- **profile**: one request's decode steps at c = 1 in bf16 under `torch.profiler`: wall ms a step,
  CUDA kernels launched a step, the GPU's busy time a step, and the ops that take the host's time
  (what bounds a small model's step on a GPU: launches, not bytes); eager, and with decode graphs
  under `graphs`.
- **w4a16** (CUDA only): the INT4 GEMV (`kernels.w4a16_gemm`, groups 128 and 32) against torch's bf16
  GEMV at M = 1 over Llama-3-8B's projection shapes, eager and replayed in a CUDA graph, with a sweep of
  the GEMV's forms and tiles; the target is >= 3x.

On a CPU (`--device cpu`) every part but w4a16 runs the same code: that is how its test checks it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = ["random_checkpoint", "write_skeleton", "parity", "served", "decode", "profile", "w4a16", "main"]

SKELETON_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
PARTS = ("parity", "served", "decode", "profile", "w4a16")


def write_skeleton(model_dir: Path, dst: Path) -> Path:
    """Copy a model's config and tokenizer files (no weights) to `dst`."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in SKELETON_FILES:
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, dst / name)
    return dst


def random_checkpoint(skeleton: Path, dst: Path, seed: int = 0) -> Path:
    """A Llama-layout checkpoint of `skeleton`'s config with random bfloat16 weights (std 0.02, norms near 1),
    written with the skeleton's files to `dst`."""
    from safetensors.torch import save_file

    write_skeleton(skeleton, dst)
    cfg = json.loads((skeleton / "config.json").read_text())
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    hd = cfg.get("head_dim") or h // heads
    gen = torch.Generator().manual_seed(seed)

    def dense(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).bfloat16()

    def norm() -> torch.Tensor:
        return (1 + 0.1 * torch.randn(h, generator=gen)).bfloat16()

    tensors = {"model.embed_tokens.weight": dense(cfg["vocab_size"], h), "model.norm.weight": norm()}
    if not cfg.get("tie_word_embeddings", False):
        tensors["lm_head.weight"] = dense(cfg["vocab_size"], h)
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": dense(heads * hd, h), p + "self_attn.k_proj.weight": dense(kv_heads * hd, h),
            p + "self_attn.v_proj.weight": dense(kv_heads * hd, h), p + "self_attn.o_proj.weight": dense(h, heads * hd),
            p + "mlp.gate_proj.weight": dense(inter, h), p + "mlp.up_proj.weight": dense(inter, h),
            p + "mlp.down_proj.weight": dense(h, inter), p + "input_layernorm.weight": norm(),
            p + "post_attention_layernorm.weight": norm()})
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def _generate(model_dir: Path, config: Any, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    from backend.engine import LLMEngine
    from backend.sampling_params import SamplingParams

    engine = LLMEngine.from_pretrained(model_dir, config)
    seqs = [engine.add_request(p, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
            for p in prompts]
    while engine.has_work():
        engine.step()
    return [list(s.output_ids) for s in seqs]


def parity(model_dir: Path, device: str, tokens: int = 32) -> dict[str, Any]:
    """Greedy tokens on `device` in float32 against the CPU's, and with decode graphs against without (module doc)."""
    from backend.engine import EngineConfig
    from ops.bench.harness.prompts import random_prompts

    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts = random_prompts(vocab, 4, 24, seed=7)

    def run(dev: str, graphs: bool = False) -> list[list[int]]:
        return _generate(model_dir, EngineConfig(dtype="float32", kv_format="fp32", device=dev, kv_cache_bytes=64 << 20,
                                                 cuda_graphs=graphs), prompts, tokens)

    cpu = run("cpu")
    ours = cpu if device == "cpu" else run(device)
    graphs = run(device, graphs=True)
    return {"equal": ours == cpu and graphs == ours, "first_mismatch": _first_mismatch(ours, cpu),
            "graphs_equal": graphs == ours, "graphs_first_mismatch": _first_mismatch(graphs, ours), "tokens": tokens,
            "device_lens": [len(x) for x in ours], "device_tokens": ours, "cpu_tokens": cpu,
            "graphs_tokens": graphs}


def _first_mismatch(runs: list[list[int]], reference: list[list[int]]) -> list[int | None]:
    """Where each prompt's tokens part; a side cut short (a failed step ends its requests) parts where it ends."""
    return [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None if len(x) == len(y) else min(len(x), len(y)))
            for x, y in zip(runs, reference, strict=True)]


def served(model_dir: Path, device: str, logs: Path, max_tokens: int = 16) -> dict[str, Any]:
    """One streamed chat completion through `edgeserve up` with FP8 KV pages and INT4 decode weights."""
    import httpx

    from ops.bench.e2e import edgeserve_up
    from ops.bench.e2e_load import MODEL

    extra = ("--device", device, "--dtype", "bfloat16", "--kv-format", "fp8_e4m3", "--decode-weights", "int4",
             "--int4-group-size", "32", "--kv-cache-bytes", "256M")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say something."}], "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    chunks, text, finish, usage, done = 0, "", None, None, False
    started = time.perf_counter()
    with edgeserve_up(model_dir, extra, logs, timeout_s=300) as cluster:
        up_s = time.perf_counter() - started
        with httpx.stream("POST", cluster.chat_url, json=body, headers=cluster.headers, timeout=120) as resp:
            status = resp.status_code
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                event = json.loads(line[len("data: "):])
                chunks += 1
                for choice in event.get("choices", []):
                    text += (choice.get("delta") or {}).get("content") or ""
                    finish = choice.get("finish_reason") or finish
                usage = event.get("usage") or usage
    ok = status == 200 and done and finish in ("length", "stop") and bool(usage) \
        and usage.get("completion_tokens", 0) >= 1
    return {"ok": ok, "status": status, "chunks": chunks, "done": done, "finish_reason": finish, "usage": usage,
            "text": text, "startup_s": round(up_s, 1), "flags": list(extra)}


def decode(model_dir: Path, device: str, levels: tuple[int, ...] = (1, 32), prompt_len: int = 64,
           output_tokens: int = 128, rounds: int = 2) -> dict[str, Any]:
    """Decode tok/s, bf16 against FP8 KV + INT4 decode weights, each eager and with decode graphs, closed loops
    stepped in turn (module doc)."""
    from backend.engine import EngineConfig, LLMEngine
    from ops.bench.harness.loops import ClosedLoop, step_in_turn
    from ops.bench.harness.prompts import random_prompts

    formats = {"bf16": dict(kv_format="bf16", cuda_graphs=False),
               "fp8_kv+int4": dict(kv_format="fp8_e4m3", decode_weights="int4", int4_group_size=32, cuda_graphs=False)}
    arms = {**formats, **{f"{name}+graphs": dict(kw, cuda_graphs=True) for name, kw in formats.items()}}
    engines = {name: LLMEngine.from_pretrained(model_dir, EngineConfig(
        dtype="bfloat16", device=device, kv_cache_bytes=512 << 20, max_num_seqs=max(levels), **kw))
        for name, kw in arms.items()}
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    out: dict[str, Any] = {"prompt_tokens": prompt_len, "output_tokens": output_tokens, "rounds": rounds, "levels": {}}
    for c in levels:
        prompts = random_prompts(vocab, 2 * c, prompt_len, seed=c)
        tokens = dict.fromkeys(arms, 0)
        clock = dict.fromkeys(arms, 0.0)
        for _ in range(rounds):
            loops = [ClosedLoop(engine, name, prompts, c, 2 * c, output_tokens) for name, engine in engines.items()]
            step_in_turn(loops)
            for loop in loops:
                tokens[loop.kv] += loop.tokens
                clock[loop.kv] += loop.clock
        tok_s = {name: tokens[name] / clock[name] for name in arms}
        out["levels"][str(c)] = {"tok_s": tok_s, "ratio": tok_s["fp8_kv+int4"] / tok_s["bf16"],
                                 "ratio_graphs": tok_s["fp8_kv+int4+graphs"] / tok_s["bf16+graphs"],
                                 "graphs_over_eager": {name: tok_s[f"{name}+graphs"] / tok_s[name] for name in formats}}
    return out


def profile(model_dir: Path, device: str, steps: int = 16) -> dict[str, Any]:
    """Where a c = 1 bf16 decode step's time goes, eager and with decode graphs (module doc)."""
    out = _profile(model_dir, device, steps, graphs=False)
    out["graphs"] = _profile(model_dir, device, steps, graphs=True)
    return out


def _profile(model_dir: Path, device: str, steps: int, graphs: bool) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from backend.engine import EngineConfig, LLMEngine
    from backend.sampling_params import SamplingParams
    from ops.bench.harness.prompts import random_prompts

    engine = LLMEngine.from_pretrained(model_dir, EngineConfig(dtype="bfloat16", kv_format="bf16", device=device,
                                                               kv_cache_bytes=64 << 20, cuda_graphs=graphs))
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    engine.add_request(random_prompts(vocab, 1, 64, seed=3)[0],
                       SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True))
    for _ in range(4):  # prefill and the first decode steps: compiles, allocations and the capture out of the way
        engine.step()
    cuda = device == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with torch_profile(activities=activities) as prof:
        started = time.perf_counter()
        for _ in range(steps):
            engine.step()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - started
    events = prof.key_averages()
    kernels = [e for e in events if cuda and getattr(e, "device_time_total", 0) > 0 and e.cpu_time_total == 0]
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    graph_state = engine.runner.graphs
    return {"steps": steps, "ms_per_step": 1e3 * wall / steps,
            "kernels_per_step": sum(e.count for e in kernels) / steps,
            "gpu_busy_ms_per_step": sum(e.self_device_time_total for e in kernels) / 1e3 / steps,
            **({"graph_replays": graph_state.replays, "graphs_failed": graph_state.failed} if graph_state else {}),
            "top_host_ops": [{"op": e.key, "calls_per_step": e.count / steps,
                              "self_cpu_ms_per_step": e.self_cpu_time_total / 1e3 / steps} for e in top]}


W4A16_SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336))  # Llama-3-8B's projections (N, K)
W4A16_SWEEP = (tuple(("bytes", bn, bb, nw) for bn in (8, 16, 32) for bb in (128, 256, 512) for nw in (4, 8))
               + tuple((form, bn, bb, 4) for form in ("words", "words-prefetch") for bn in (16, 32, 64)
                       for bb in (256, 512)))  # (GEMV form, rows, bytes a row, warps)
L2_FLUSH_BYTES = 256 << 20  # weight copies a timed loop cycles through: past the L2 cache (an H200's: 50 MB)


def _cycling(fn: Callable[[Any], Any], copies: list[Any]) -> Callable[[], Any]:
    """fn over the next copy each call: a graph of unrolled calls then reads every copy in turn from memory,
    not one copy from L2 (what `do_bench_cudagraph` would otherwise time for a weight that fits in L2)."""
    turn = itertools.count()
    return lambda: fn(copies[next(turn) % len(copies)])


def w4a16(shapes: tuple[tuple[int, int], ...] = W4A16_SHAPES, groups: tuple[int, ...] = (128, 32)) -> dict[str, Any]:
    """The Triton INT4 GEMV against torch's bf16 GEMV at M = 1 (CUDA only): each timed as called (CUDA-event
    medians, `do_bench`, which flushes L2 between calls: what an eager decode step pays, launch included) and
    replayed in a CUDA graph (`do_bench_cudagraph`: the kernels alone, what a decode step with graphs pays; the
    calls cycle through weight copies of 256 MB in all, so they read memory as a model's layers do), the
    launcher's default tile against a sweep of the GEMV's forms (bytes; int32 words, with and without the next
    tile in flight) and rows and bytes a tile and warps (`W4A16_SWEEP`, graph-timed, K split as the launcher
    chooses), per group size; `best_by_form` is each form's fastest setting."""
    from triton.testing import do_bench, do_bench_cudagraph

    from kernels.w4a16_gemm import gemv_tile, quantize_int4_ref, w4a16_gemm

    rows = []
    for group in groups:
        for n, k in shapes:
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                     for _ in range(max(2, -(-L2_FLUSH_BYTES // (2 * n * k))))]
            packed = [quantize_int4_ref(dense[0], group)]
            copies = max(2, -(-L2_FLUSH_BYTES // (n * k // 2)))
            packed += [tuple(t.clone() for t in packed[0]) for _ in range(copies - 1)]
            w, (q, s, z) = dense[0], packed[0]
            int4_graph = _cycling(lambda qsz: w4a16_gemm(x, *qsz, group), packed)
            bf16_graph = _cycling(lambda wc: x @ wc.t(), dense)
            sweep = {f"{form}:n{bn}b{bb}w{nw}": do_bench_cudagraph(_cycling(
                lambda qsz, f=form, bn=bn, bb=bb, nw=nw: w4a16_gemm(x, *qsz, group, block_n=bn, block_b=bb,
                                                                   num_warps=nw, kernel=f),
                packed), rep=10) for form, bn, bb, nw in W4A16_SWEEP}
            best = min(sweep, key=sweep.get)
            int4_ms = do_bench(lambda: w4a16_gemm(x, q, s, z, group))
            bf16_ms = do_bench(lambda: x @ w.t())
            int4_graph_ms = do_bench_cudagraph(int4_graph)
            bf16_graph_ms = do_bench_cudagraph(bf16_graph)
            int4_bytes = q.numel() + 2 * (s.numel() + z.numel())
            rows.append({"group_size": group, "n": n, "k": k, "default_tile": gemv_tile(1, n, k, group)._asdict(),
                         "int4_us": int4_ms * 1e3, "bf16_us": bf16_ms * 1e3, "speedup": bf16_ms / int4_ms,
                         "int4_graph_us": int4_graph_ms * 1e3, "bf16_graph_us": bf16_graph_ms * 1e3,
                         "speedup_graph": bf16_graph_ms / int4_graph_ms,
                         "int4_gb_s": int4_bytes / (int4_ms * 1e-3) / 1e9,
                         "bf16_gb_s": 2 * n * k / (bf16_ms * 1e-3) / 1e9,
                         "int4_graph_gb_s": int4_bytes / (int4_graph_ms * 1e-3) / 1e9,
                         "bf16_graph_gb_s": 2 * n * k / (bf16_graph_ms * 1e-3) / 1e9,
                         "sweep_graph_us": {key: ms * 1e3 for key, ms in sweep.items()}, "sweep_best": best,
                         "best_by_form": {f: min((key for key in sweep if key.startswith(f + ":")), key=sweep.get)
                                          for f in dict.fromkeys(form for form, *_ in W4A16_SWEEP)},
                         "speedup_graph_best": bf16_graph_ms / sweep[best]})
            print(f"w4a16 g{group} {n}x{k}: graph {int4_graph_ms * 1e3:.1f} us (bf16 {bf16_graph_ms * 1e3:.1f}), "
                  f"eager {int4_ms * 1e3:.1f} (bf16 {bf16_ms * 1e3:.1f}), best {best} {sweep[best] * 1e3:.1f} us",
                  flush=True)
            del dense, packed
    return {"results": rows, "speedup_min": min(r["speedup"] for r in rows),
            "speedup_graph_min": min(r["speedup_graph"] for r in rows),
            "target_3x_met": min(r["speedup"] for r in rows) >= 3.0}


def _model(args: argparse.Namespace, scratch: Path) -> tuple[Path, str]:
    """The model to run and where it came from (module doc)."""
    if args.model:
        return Path(args.model), "given"
    pulled = Path.home() / ".cache/edgeserve/models/smollm2-135m"
    if (pulled / "model.safetensors").exists():
        return pulled, "pulled smollm2-135m"
    return random_checkpoint(Path(args.skeleton), scratch / "model"), f"random weights on {args.skeleton}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--json", default="bench-results/gpu_engine.json")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--parts", default=",".join(PARTS))
    p.add_argument("--model", default=None, help="a model folder (default: the pulled SmolLM2, else --skeleton)")
    p.add_argument("--skeleton", default=".gpu/smollm2-135m", help="config and tokenizer for random weights")
    p.add_argument("--write-skeleton", default=None, metavar="DIR", help="write the pulled SmolLM2's skeleton to DIR")
    p.add_argument("--levels", default="1,32")
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    if args.write_skeleton:
        from ops.pull import resolve_model

        print(f"wrote {write_skeleton(resolve_model('smollm2-135m'), Path(args.write_skeleton))}")
        return 0
    from ops.bench.report import write_report

    parts = [s for s in args.parts.split(",") if s]
    report: dict[str, Any] = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}
    with tempfile.TemporaryDirectory(prefix="edgeserve-gpu-") as tmp:
        scratch = Path(tmp)
        model_dir, report["model"] = _model(args, scratch)
        runs: dict[str, Callable[[], dict[str, Any]]] = {
            "parity": lambda: parity(model_dir, args.device),
            "served": lambda: served(model_dir, args.device, scratch),
            "decode": lambda: decode(model_dir, args.device, tuple(int(c) for c in args.levels.split(",")),
                                     output_tokens=args.output_tokens, rounds=args.rounds),
            "profile": lambda: profile(model_dir, args.device),
            "w4a16": lambda: w4a16() if args.device == "cuda" else {"skipped": "needs CUDA"}}
        for part in parts:
            started = time.perf_counter()
            try:
                report[part] = runs[part]()
            except Exception as exc:  # noqa: BLE001 - recorded, and the next part runs
                report[part] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
            report[part]["seconds"] = round(time.perf_counter() - started, 1)
            print(f"{part}: {json.dumps({k: v for k, v in report[part].items() if 'tokens' not in k})[:600]}",
                  flush=True)
            if args.device == "cuda":
                torch.cuda.empty_cache()
    write_report(args.json, report)
    failed = [p for p in parts if "error" in report[p] or report[p].get("ok") is False
              or report[p].get("equal") is False]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
