"""MLA: latent KV bytes and admitted requests per format, absorbed vs non-absorbed decode, real-model KV budgets.

Model: a random `DeepseekV3ForCausalLM` written once per run into a temporary
directory by transformers itself (`DeepseekV3ForCausalLM(config).save_pretrained`,
its own random init, float32), sized for a 2-core CPU but with the real MLA widths
so the KV figures are the real ones: kv_lora_rank 512, qk_rope_head_dim 64,
qk_nope_head_dim 128, v_head_dim 128, q_lora_rank 256, 16 heads, hidden 512,
4 layers (the first dense, intermediate 1024), 16 routed experts of 256 (top-4,
4 groups keeping 2, one shared), vocab 4096, no YaRN. `--quick`: 2 layers.
Float32 compute, tokenizer-free (random token ids).

1. **KV bytes per token** per latent format (fp32, bf16, fp8_e4m3), all layers,
   from `backend.kv_cache.kv_bytes_per_token` (the pool's own sizing).
2. **Admitted requests at one byte budget**: every request is P + O tokens and
   admission reserves ceil((P + O) / page) pages up front, so a pool admits
   pages // pages_per_request of them. The budget is exactly N BF16 requests'
   bytes (N 8, quick 4); an engine per format gets that budget and 3N requests at
   once, and the requests RUNNING after its first step are counted (and checked
   against the page arithmetic). FP8 rows are 656 B per layer against BF16's 1,152
   (1.756x), so FP8 admits floor(1.756 N) (14 for N 8: 1.75x; target >= 1.7x).
3. **Decode tok/s, absorbed vs non-absorbed**: two engines on the same checkpoint
   and fp32 latent KV, one with `model.mla_absorb` on (decode attends over the
   latent rows, W_UK folded into the query, W_UV after), one off (every decode
   step expands the whole context's latents with kv_b_proj per head). At each c
   (1, 8, 32) both get the same c requests of P random prompt tokens + O outputs
   (P 64, O 16 at c <= 8 and 8 above; quick P 16, O 6), greedy, EOS ignored,
   stepped in turn with the first mover alternating (`step_in_turn`); tok/s = c /
   median decode-step time (steps where every request has a token). R rounds
   (3, quick 1) over all c, interleaved; the figure is the median over rounds, and
   the ratio of those medians is shown beside each round's own (paired) ratio.
4. **KV budget of the real models**: `edgeserve kv-budget` figures (tokens per
   format in 46.8 GiB per GPU at TP 8, pages of 16) for Kimi K2.6 and GLM-5.

Targets: FP8 admits >= 1.7x BF16's requests; absorbed decode beats non-absorbed
from c = 8 on.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ops.bench.harness.loops import DecodeLoop, step_in_turn
from ops.bench.harness.machine import load_average_text
from ops.bench.harness.progress import log
from ops.bench.harness.prompts import random_prompts
from ops.bench.report import provenance, write_report
from ops.cluster import machine_info

__all__ = ["add_arguments", "run", "model_config", "write_random_deepseek_v3", "admitted_at_budget",
           "decode_rounds", "targets", "format_table", "main", "LATENT_FORMATS", "PATHS", "BUDGET_MODELS"]

LATENT_FORMATS = ("fp32", "bf16", "fp8_e4m3")
PATHS = ("absorbed", "non_absorbed")  # decode paths, the value of model.mla_absorb: True, False
BUDGET_MODELS = ("kimi-k2.6", "glm-5")
BUDGET_SETTING = {"free_gib": 46.8, "tp": 8, "page_size": 16}
ADMIT_TARGET = 1.7


def model_config(hidden: int = 512, layers: int = 4, heads: int = 16, experts: int = 16, top_k: int = 4,
                 inter: int = 256, vocab: int = 4096, kv_lora_rank: int = 512, rope_dim: int = 64,
                 nope_dim: int = 128, v_dim: int = 128, q_lora_rank: int | None = 256) -> dict[str, Any]:
    """`DeepseekV3Config` keyword arguments of the benchmark model (see the module docstring)."""
    groups = 4 if experts % 4 == 0 and experts >= 8 else 1
    return dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=inter,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank, qk_nope_head_dim=nope_dim,
                qk_rope_head_dim=rope_dim, v_head_dim=v_dim, n_routed_experts=experts, num_experts_per_tok=top_k,
                n_shared_experts=1, n_group=groups, topk_group=max(1, groups // 2),
                first_k_dense_replace=1 if layers > 1 else 0, routed_scaling_factor=2.5, norm_topk_prob=True,
                max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0, rope_interleave=True,
                attention_bias=False, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
                num_nextn_predict_layers=0, architectures=["DeepseekV3ForCausalLM"])


def write_random_deepseek_v3(path: Path, cfg_kwargs: dict[str, Any], seed: int = 0) -> Path:
    """Write transformers' randomly initialised `DeepseekV3ForCausalLM(DeepseekV3Config(**cfg_kwargs))`
    (float32) to `path` with `save_pretrained`: config.json and safetensors with the real names."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**cfg_kwargs))
    model.save_pretrained(path)
    return Path(path)


def admitted_at_budget(engine, prompt: list[int], output_tokens: int, requests: int) -> int:
    """Submit `requests` copies of P + O, step once, and count the requests RUNNING (admitted)."""
    from backend.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
    for _ in range(requests):
        engine.add_request(prompt, params)
    for out in engine.step():
        if out.error is not None:
            raise out.error
    return len(engine.scheduler.running)


def decode_rounds(engines: dict[str, Any], prompts: list[list[int]], points: list[int], rounds: int,
                  output_tokens: dict[int, int], log=lambda msg: None) -> dict[str, dict[str, list[float]]]:
    """Per path and c, the tok/s of each round (c / median decode-step time), paths stepped in turn."""
    per_round: dict[str, dict[str, list[float]]] = {path: {str(c): [] for c in points} for path in engines}
    for r in range(rounds):
        for c in points:
            loops = [DecodeLoop(e, path, prompts, c, c, output_tokens[c]) for path, e in engines.items()]
            step_in_turn(loops if r % 2 == 0 else loops[::-1])
            for loop in loops:
                per_round[loop.kv][str(c)].append(loop.median_tok_s())
            log(f"round {r + 1} c={c}: " + ", ".join(f"{p} {per_round[p][str(c)][-1]:.1f}" for p in engines)
                + " tok/s")
    return per_round


def targets(admitted: dict[str, int], decode: dict[str, dict[str, float]]) -> tuple[dict[str, Any], dict[str, bool]]:
    """Ratios (FP8/BF16 requests admitted; absorbed/non-absorbed tok/s per c) and whether targets hold:
    FP8 admits >= ADMIT_TARGET x BF16, absorbed faster at every c >= 8 measured."""
    admit_ratio = admitted["fp8_e4m3"] / admitted["bf16"] if admitted.get("bf16") else 0.0
    speedup = {c: decode["absorbed"][c] / decode["non_absorbed"][c] for c in decode["absorbed"]
               if c in decode.get("non_absorbed", {})}
    from_8 = [v for c, v in speedup.items() if int(c) >= 8]
    ratios = {"admitted_fp8_vs_bf16": admit_ratio, "absorbed_vs_non_absorbed": speedup}
    return ratios, {f"admitted_fp8_vs_bf16_ge_{ADMIT_TARGET:g}x": admit_ratio >= ADMIT_TARGET,
                    "absorbed_wins_from_c8": bool(from_8) and all(v > 1.0 for v in from_8)}


def format_table(report: dict[str, Any]) -> str:
    """The printed summary of a report."""
    cfg, m = report["config"], report["machine"]
    model = cfg["model"]
    lines = [f"edgeserve bench mla{' (quick)' if report['quick'] else ''}: random DeepseekV3, hidden "
             f"{model['hidden_size']}, {model['num_hidden_layers']} layers, {model['num_attention_heads']} heads, "
             f"kv_lora_rank {model['kv_lora_rank']}, rope {model['qk_rope_head_dim']}, nope "
             f"{model['qk_nope_head_dim']}, v {model['v_head_dim']}, {model['n_routed_experts']} experts "
             f"top-{model['num_experts_per_tok']}, vocab {model['vocab_size']}; float32, threads {report['threads']}",
             f"machine: {m.get('cpu_model')}, {m.get('cpus_usable')}/{m.get('cpu_count')} CPUs; load "
             f"{' '.join(report['load_avg_before'])} -> {' '.join(report['load_avg_after'])}", "",
             "latent KV bytes per token (all layers): " + ", ".join(
                 f"{f} {b:,}" for f, b in report["kv_bytes_per_token"].items()),
             f"admitted at {cfg['budget_bytes']:,} B (exactly {cfg['bf16_requests']} BF16 requests of "
             f"{cfg['admit_prompt_tokens']} + {cfg['admit_output_tokens']} tokens): " + ", ".join(
                 f"{f} {n}" for f, n in report["admitted"].items())
             + f" -> {report['ratios']['admitted_fp8_vs_bf16']:.2f}x", "",
             f"decode tok/s ({cfg['prompt_tokens']}-token prompts, fp32 latent KV, median decode step, median of "
             f"{cfg['rounds']} interleaved rounds)",
             f"{'c':>4}" + "".join(f"{p:>14}" for p in PATHS) + f"{'absorbed/non':>14}  per round"]
    dec, rounds = report["decode_tok_s"], report["ratios"].get("absorbed_vs_non_absorbed_rounds", {})
    for c in map(str, cfg["concurrency"]):
        lines.append(f"{c:>4}" + "".join(f"{dec[p][c]:>14.1f}" for p in PATHS)
                     + f"{report['ratios']['absorbed_vs_non_absorbed'][c]:>13.2f}x  "
                     + " ".join(f"{r:.2f}" for r in rounds.get(c, [])))
    s = report["kv_budget_setting"]
    lines += ["", f"real models, tokens in {s['free_gib']} GiB per GPU at TP {s['tp']} (pages of {s['page_size']}; "
                  "`edgeserve kv-budget`):"]
    for name, toks in report["kv_budget"].items():
        lines.append(f"  {name:<10} " + ", ".join(f"{f} {t:,}" for f, t in toks.items()))
    lines.append("targets: " + ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in report["targets"].items()))
    return "\n".join(lines)


# ---------------------------------------------------------------- command

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 4; quick 2)")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-lora-rank", type=int, default=512)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--prompt-tokens", type=int, default=None, help="P (default 64; quick 16)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved decode rounds (default 3; quick 1)")
    p.add_argument("--bf16-requests", type=int, default=None, help="N: the budget holds N BF16 requests (8; quick 4)")
    p.add_argument("--threads", type=int, default=None)


def _output_tokens(c: int, quick: bool) -> int:
    return 6 if quick else (16 if c <= 8 else 8)


def run(args: argparse.Namespace) -> int:
    from backend.config import load_config
    from backend.engine import EngineConfig, LLMEngine
    from backend.kv_cache import kv_bytes_per_token, pages_for_budget
    from ops.kv_budget import GIB, budget_tokens, kv_budget
    from ops.model_configs import load_model_config

    quick = args.quick
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    load_before = load_average_text()
    cfg_kwargs = model_config(hidden=args.hidden, layers=args.layers or (2 if quick else 4), heads=args.heads,
                              experts=args.experts, vocab=args.vocab, kv_lora_rank=args.kv_lora_rank)
    points = [int(c) for c in args.concurrency.split(",")]
    prompt_tokens = args.prompt_tokens or (16 if quick else 64)
    rounds = args.rounds or (1 if quick else 3)
    n_bf16 = args.bf16_requests or (4 if quick else 8)
    out_tokens = {c: _output_tokens(c, quick) for c in points}
    page_size = 16
    timings: dict[str, float] = {}

    with tempfile.TemporaryDirectory(prefix="bench-mla-") as tmp:
        t = time.perf_counter()
        model_dir = write_random_deepseek_v3(Path(tmp), cfg_kwargs)
        cfg = load_config(model_dir)
        timings["write_model_s"] = time.perf_counter() - t
        t = time.perf_counter()

        # -- 1, 2. bytes per token, and requests admitted at one budget
        kv_bytes = {fmt: kv_bytes_per_token(cfg, fmt) for fmt in LATENT_FORMATS}
        admit_out = out_tokens[points[0]]
        pages_per_request = -(-(prompt_tokens + admit_out) // page_size)
        budget = n_bf16 * pages_per_request * page_size * kv_bytes["bf16"]
        expected = {fmt: pages_for_budget(cfg, fmt, budget, page_size) // pages_per_request
                    for fmt in ("bf16", "fp8_e4m3")}
        offered = 3 * n_bf16
        admit_prompt = random_prompts(cfg.vocab_size, 1, prompt_tokens, seed=2)[0]
        admitted: dict[str, int] = {}
        for fmt in ("bf16", "fp8_e4m3"):
            engine = LLMEngine.from_pretrained(model_dir, EngineConfig(
                dtype="float32", kv_format=fmt, kv_cache_bytes=budget, page_size=page_size, max_num_seqs=offered,
                max_num_batched_tokens=offered * prompt_tokens, prefill_chunk_size=prompt_tokens,
                max_model_len=prompt_tokens + 64))
            admitted[fmt] = admitted_at_budget(engine, admit_prompt, admit_out, offered)
            del engine
            log(f"admitted {fmt}: {admitted[fmt]} (pages say {expected[fmt]})")
        timings["admit_s"] = time.perf_counter() - t

        # -- 3. decode, absorbed vs non-absorbed, stepped in turn
        max_c = max(points)
        kv_tokens = max_c * (prompt_tokens + max(out_tokens.values()) + page_size)
        engines: dict[str, Any] = {}
        for path in PATHS:
            engines[path] = LLMEngine.from_pretrained(model_dir, EngineConfig(
                dtype="float32", kv_format="fp32", kv_cache_bytes=kv_tokens * kv_bytes["fp32"], page_size=page_size,
                max_num_seqs=max_c, max_num_batched_tokens=max(512, max_c * prompt_tokens),
                prefill_chunk_size=max(256, prompt_tokens), max_model_len=prompt_tokens + 64))
            engines[path].model.mla_absorb = path == "absorbed"
    t = time.perf_counter()
    prompts = random_prompts(cfg.vocab_size, max_c, prompt_tokens)
    decode_rounds(engines, prompts, [min(2, max_c)], 1, {min(2, max_c): 3})  # warm-up
    per_round = decode_rounds(engines, prompts, points, rounds, out_tokens, log)
    del engines
    decode = {path: {c: statistics.median(v) for c, v in row.items()} for path, row in per_round.items()}
    timings["decode_s"] = time.perf_counter() - t

    # -- 4. the real models' budgets
    budgets = {}
    for name in BUDGET_MODELS:
        label, real = load_model_config(name)
        budgets[label] = budget_tokens(kv_budget(real, int(BUDGET_SETTING["free_gib"] * GIB), BUDGET_SETTING["tp"],
                                                 BUDGET_SETTING["page_size"], model=label))
    timings["total_s"] = time.perf_counter() - started
    load_after = load_average_text()

    ratios, met = targets(admitted, decode)
    # paired per round (the two paths ran side by side, so a burst of load hits both)
    ratios["absorbed_vs_non_absorbed_rounds"] = {
        c: [a / n for a, n in zip(per_round["absorbed"][c], per_round["non_absorbed"][c])] for c in decode["absorbed"]}
    prov = provenance()
    if Path(sys.argv[0]).resolve() == Path(__file__).resolve():  # `python -m ops.bench.mla`, not edgeserve
        prov["command"] = " ".join(["python -m ops.bench.mla", *sys.argv[1:]])
    report = {
        **prov, "quick": quick, "threads": torch.get_num_threads(), "machine": machine_info(),
        "load_avg_before": load_before, "load_avg_after": load_after,
        "config": {"model": cfg_kwargs, "page_size": page_size, "concurrency": points, "prompt_tokens": prompt_tokens,
                   "output_tokens": {str(c): o for c, o in out_tokens.items()}, "rounds": rounds,
                   "decode_kv_format": "fp32", "bf16_requests": n_bf16, "budget_bytes": budget,
                   "admit_prompt_tokens": prompt_tokens, "admit_output_tokens": admit_out,
                   "admit_offered": offered},
        "kv_bytes_per_token": kv_bytes, "admitted": admitted, "admitted_by_pages": expected,
        "decode_tok_s": decode, "decode_tok_s_rounds": per_round, "ratios": ratios, "targets": met,
        "kv_budget": budgets, "kv_budget_setting": BUDGET_SETTING, "timings_s": timings,
    }
    print("\n" + format_table(report) + f"\ntook {timings['total_s']:.0f} s")
    write_report(args.json_path, report)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m ops.bench.mla [--quick] [--json PATH] ...`: the same run as `edgeserve bench mla`."""
    parser = argparse.ArgumentParser(prog="python -m ops.bench.mla", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run (smoke test of the command)")
    parser.add_argument("--json", dest="json_path", default="bench-results/mla.json", help="where to write JSON")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
