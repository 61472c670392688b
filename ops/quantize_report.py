"""The size report `edgeserve quantize` prints and `bench weights` reads: input and output bytes,
the linear layers' share, per-GPU bytes at tensor parallel 1 and 8, the method, calibration,
wall seconds and peak resident memory.

Per-GPU bytes: column-parallel (q/k/v, gate/up) and row-parallel (o, down) linears, their
scales (and routed experts), and the vocab-parallel embedding and LM head are split 1/TP; k/v
projections are replicated when TP exceeds the number of KV heads (each GPU needs one whole KV
head); MLA's latent down-projections (q_a_proj, kv_a_proj_with_mqa) and the DSA indexer, like
everything else (norms, the router, biases), are held whole by every GPU, as the tensor-parallel
runtime (`backend/distributed/sharding.py`) holds them. Peak RSS is
Linux's VmHWM (getrusage's ru_maxrss where /proc is absent). Arithmetic on the output tensors, not
a sharding plan.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from backend.config import ModelConfig
from backend.weight_formats import TensorSpec, WeightFormat
from ops.calibration import CalibrationStats

if TYPE_CHECKING:
    from ops.quantize_steps import QuantizePlan

__all__ = ["SizeReport", "per_gpu_bytes", "size_report", "peak_rss_bytes", "print_report"]

_REPLICATED = ("q_a_proj", "kv_a_proj_with_mqa")  # MLA latent down-projections: the latent is replicated


@dataclass
class SizeReport:
    input_bytes: int
    output_bytes: int
    input_linear_bytes: int
    output_linear_bytes: int
    per_gpu_bytes: dict[int, int]  # tensor parallel degree -> output weight bytes per GPU
    method: str = "rtn"  # rtn (round to nearest), gptq or awq
    quantize_s: float = 0.0  # wall seconds of the whole conversion (calibration included)
    peak_rss_bytes: int = 0  # the process's peak resident memory so far (`peak_rss_bytes()`)
    calibration: CalibrationStats | None = None  # gptq and awq only

    @property
    def ratio(self) -> float:
        return self.output_bytes / self.input_bytes

    @property
    def linear_ratio(self) -> float:
        return self.output_linear_bytes / self.input_linear_bytes


def per_gpu_bytes(specs: dict[str, TensorSpec], cfg: ModelConfig, tp: int) -> int:
    """Weight bytes one GPU holds at tensor parallel `tp` (rules in the module docstring)."""
    total = 0
    for name, spec in specs.items():
        module = name.rsplit(".", 1)[0]
        if module.endswith(("k_proj", "v_proj")):
            share = min(tp, cfg.num_kv_heads)  # replicated once TP exceeds the KV heads
        elif module.endswith(_REPLICATED) or ".indexer." in module:
            share = 1  # as backend/distributed/sharding.py holds them: whole on every rank
        elif module.endswith("_proj") or name in ("model.embed_tokens.weight", "lm_head.weight"):
            share = tp
        else:
            share = 1
        total += -(-spec.nbytes // share)
    return total


def size_report(plan: QuantizePlan) -> SizeReport:
    out = plan.output_specs
    fused = {piece.tensor for piece in plan.slices.values()}
    linear_in = sum(s.nbytes for n, s in plan.input_specs.items()
                    if n.rsplit(".", 1)[0] in plan.linear_modules or n in fused)
    linear_out = sum(s.nbytes for n, s in out.items() if n.rsplit(".", 1)[0] in plan.linear_modules)
    return SizeReport(sum(s.nbytes for s in plan.input_specs.values()), sum(s.nbytes for s in out.values()),
                      linear_in, linear_out, {tp: per_gpu_bytes(out, plan.cfg, tp) for tp in (1, 8)})


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far: Linux's VmHWM of /proc/self/status, which
    starts afresh at exec (getrusage's ru_maxrss, used where /proc is absent, keeps the peak of the
    process a child was forked from: a quantiser started by an 8 GB benchmark would report 8 GB)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _gb(n: int) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def print_report(report: SizeReport, target: WeightFormat, cfg: ModelConfig) -> None:
    print(f"size report ({target!r}; tensor bytes, headers excluded)")
    print(f"  input          {_gb(report.input_bytes):>12}   ({report.input_bytes:,} B)")
    print(f"  output         {_gb(report.output_bytes):>12}   ({report.output_bytes:,} B)")
    print(f"  ratio          {report.ratio:>12.3f}")
    print(f"  linear layers  {_gb(report.input_linear_bytes):>12} -> {_gb(report.output_linear_bytes)}"
          f"   (ratio {report.linear_ratio:.3f})")
    for tp, nbytes in report.per_gpu_bytes.items():
        note = ""
        if tp > 1 and (cfg.num_heads % tp or cfg.intermediate_size % tp or cfg.moe_intermediate_size % tp):
            note = f"   (arithmetic only: {cfg.num_heads} heads do not split {tp} ways)"
        print(f"  per GPU, TP {tp}  {_gb(nbytes):>12}{note}")
    print(f"  method         {report.method:>12}")
    cal = report.calibration
    if cal is not None:
        print(f"  calibration    {cal.tokens:>12,} tokens ({cal.sequences} x {cal.seq_len}); GPTQ on "
              f"{cal.gptq_linears} linears, {len(cal.rtn_experts)} routed experts rounded to nearest "
              f"(fewer calibration tokens than the group size)")
        if cal.tune is not None:
            t = cal.tune
            print(f"  scales tuned   {t.epochs:>12} epochs ({t.steps} steps of {t.seq_len} tokens, {t.seconds:.0f} s); "
                  f"KL to the dense model {t.kl_start:.4f} -> {t.kl_end:.4f}"
                  + (" (no better: GPTQ's scales kept)" if t.kept_gptq else ""))
        if cal.awq_alphas:
            alphas = sorted(cal.awq_alphas)
            print(f"  AWQ scales     {len(alphas):>12} inputs scaled, alpha median {alphas[len(alphas) // 2]:.2f} "
                  f"(range {alphas[0]:.2f}..{alphas[-1]:.2f})")
    print(f"  quantize time  {report.quantize_s:>10.1f} s")
    print(f"  peak RSS       {_gb(report.peak_rss_bytes):>12}")
