"""`bench weights`' measures of a format: its checkpoint's sizes, its quality against a reference, and the
quantization that writes it (in a child process, so that its peak memory is its own)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ops.scale_tune import kl_divergence

__all__ = ["checkpoint_sizes", "Quality", "quality", "quantize_in_child"]


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


def quality(engine, windows: list[list[int]], reference: Sequence[torch.Tensor] = (), keep: int = 0) -> Quality:
    """Perplexity and top-1 accuracy over `windows`, each scored from its first token; with `reference` (another
    format's `dists` of the first windows) the mean KL from it over those windows; `keep` windows' distributions
    returned (float16), to be the reference of later formats."""
    nll, hits, n, kls, dists = 0.0, 0, 0, [], []
    for j, window in enumerate(windows):
        full = j < max(len(reference), keep)
        scores = engine.score_tokens(window, dist=full)
        nll -= float(scores.logprobs.double().sum())
        hits += int(scores.top1.sum())
        n += scores.logprobs.numel()
        if full:
            this = scores.dist.float()
            if j < len(reference):
                kls.append(float(kl_divergence(reference[j], this)))
            if j < keep:
                dists.append(this.half())  # float16: log-probs to ~0.004 (bfloat16 put 2e-4 in a KL of itself)
    return Quality(math.exp(nll / n), hits / n, n, sum(kls) / len(kls) if kls else None, dists)


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
