"""`bench weights`' measures of a format: its checkpoint's sizes, its quality against a reference, and the
quantization that writes it (in a child process, so that its peak memory is its own)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from ops.bench.harness.stats import block_bootstrap_ci
from ops.scale_tune import kl_divergence

__all__ = ["checkpoint_sizes", "Quality", "quality", "paired_quality", "quantize_in_child"]

QUALITY_BLOCK = 32  # tokens resampled together in `paired_quality` (neighbouring tokens' losses correlate)


def checkpoint_sizes(model_dir) -> tuple[dict[str, int], dict[str, int]]:
    """(size_bytes, linear_size_bytes) per format, as `edgeserve quantize` would write them."""
    from backend.config import load_config
    from backend.weight_formats import weight_format
    from backend.weights import CheckpointReader
    from ops.quantize import plan_quantize, size_report

    cfg = load_config(model_dir)
    reader = CheckpointReader(model_dir, cfg.checkpoint_prefix)
    size: dict[str, int] = {}
    linear: dict[str, int] = {}
    for name, fmt, group in (("fp8", "fp8", 128), ("int4", "int4", 128), ("int4_g32", "int4", 32)):
        plan = plan_quantize(reader, cfg, weight_format(fmt, group))
        report = size_report(plan)
        size[name], linear[name] = report.output_bytes, report.output_linear_bytes
        size["bf16"], linear["bf16"] = report.input_bytes, report.input_linear_bytes
    numel = {n: math.prod(s.shape) for n, s in plan.input_specs.items()}
    size["fp32"] = 4 * sum(numel.values())
    linear["fp32"] = 4 * sum(v for n, v in numel.items() if n.rsplit(".", 1)[0] in plan.linear_modules)
    return size, linear


class Quality(NamedTuple):
    """What `quality` measured of one format."""

    ppl: float
    top1: float  # top-1 next-token accuracy, 0..1
    tokens: int  # tokens scored
    kl: float | None  # mean KL(reference || this format) over the reference's windows (None without one)
    dists: list[torch.Tensor]  # the first `keep` windows' next-token log-probabilities, float16 [len - 1, vocab]
    nll: list[np.ndarray]  # per window, each scored token's negative log-probability (float64)
    hits: list[np.ndarray]  # per window, whether each scored token was the top-1 prediction (bool)


def quality(engine, windows: list[list[int]], reference: Sequence[torch.Tensor] = (), keep: int = 0) -> Quality:
    """Perplexity and top-1 accuracy over `windows`, each scored from its first token; with `reference` (another
    format's `dists` of the first windows) the mean KL from it over those windows; `keep` windows' distributions
    returned (float16), to be the reference of later formats."""
    nll, hits, kls, dists = [], [], [], []
    for j, window in enumerate(windows):
        full = j < max(len(reference), keep)
        scores = engine.score_tokens(window, dist=full)
        nll.append(-scores.logprobs.double().numpy())
        hits.append(scores.top1.bool().numpy())
        if full:
            this = scores.dist.float()
            if j < len(reference):
                kls.append(float(kl_divergence(reference[j], this)))
            if j < keep:
                dists.append(this.half())  # float16: log-probs to ~0.004 (bfloat16 put 2e-4 in a KL of itself)
    n = sum(len(x) for x in nll)
    return Quality(math.exp(sum(float(x.sum()) for x in nll) / n), sum(int(h.sum()) for h in hits) / n, n,
                   sum(kls) / len(kls) if kls else None, dists, nll, hits)


def paired_quality(a: Quality, b: Quality) -> dict[str, Any]:
    """Format `a` against format `b` on the same windows, token by token: `a`'s perplexity over `b`'s and its
    top-1 accuracy minus `b`'s (percentage points), each with a 95% interval from a block bootstrap over the
    scored tokens (both formats' losses of a token stay paired; runs of `QUALITY_BLOCK` tokens, per window), so
    a verdict can tell a real difference from one window's luck."""
    nll = [(x, y) for x, y in zip(a.nll, b.nll, strict=True)]
    hits = [(x.astype(float), y.astype(float)) for x, y in zip(a.hits, b.hits, strict=True)]
    ppl_ratio = lambda x, y: math.exp(float(x.mean() - y.mean()))  # noqa: E731
    top1_pp = lambda x, y: 100.0 * float(x.mean() - y.mean())  # noqa: E731
    cat = lambda pairs, i: np.concatenate([p[i] for p in pairs])  # noqa: E731
    return {"ppl_ratio": ppl_ratio(cat(nll, 0), cat(nll, 1)),
            "ppl_ratio_ci95": list(block_bootstrap_ci(nll, ppl_ratio, block=QUALITY_BLOCK)),
            "top1_pp": top1_pp(cat(hits, 0), cat(hits, 1)),
            "top1_pp_ci95": list(block_bootstrap_ci(hits, top1_pp, block=QUALITY_BLOCK))}


def _quantize_job(src: str, dst: str, fmt: str, group: int, method: str, calib_tokens: int) -> dict[str, Any]:
    """Run in a fresh process: `quantize_checkpoint` and what it cost (its report's fields)."""
    from backend.weight_formats import weight_format
    from ops.quantize import quantize_checkpoint

    untuned = method.endswith("-untuned")  # GPTQ without the end-to-end scale tuning that follows it
    report = quantize_checkpoint(Path(src), Path(dst), weight_format(fmt, group),
                                 method=method.removesuffix("-untuned"), calib_tokens=calib_tokens, progress=False,
                                 tune_epochs=0 if untuned else None)
    cal = report.calibration
    tune = None if cal is None or cal.tune is None else \
        {"epochs": cal.tune.epochs, "steps": cal.tune.steps, "kl_start": cal.tune.kl_start,
         "kl_end": cal.tune.kl_end, "kept_gptq": cal.tune.kept_gptq, "seconds": cal.tune.seconds}
    return {"quantize_s": report.quantize_s, "peak_rss_bytes": report.peak_rss_bytes,
            "output_bytes": report.output_bytes,
            "calibration": None if cal is None else {"tokens": cal.tokens, "seq_len": cal.seq_len,
                                                     "gptq_linears": cal.gptq_linears,
                                                     "rtn_experts": len(cal.rtn_experts), "tune": tune}}


def quantize_in_child(src: Path, dst: Path, fmt: str, group: int, method: str, calib_tokens: int) -> dict[str, Any]:
    """`edgeserve quantize` of `src` into `dst` in a spawned process, so that its peak RSS is its own."""
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        return pool.submit(_quantize_job, str(src), str(dst), fmt, group, method, calib_tokens).result()
