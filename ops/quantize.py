"""`edgeserve quantize IN OUT --to int4|fp8 [--group-size 128] [--method gptq|awq|rtn]`: convert a checkpoint's linears.

IN is a Hugging Face folder (config.json + safetensors, one file or shards with an
index) whose linear layers are dense (BF16, FP16, FP32) or FP8 (e4m3 with block
scales, `weight_scale_inv`). The linear modules are the architecture's
(`backend/models/checkpoint_layout.py`): attention q/k/v/o and the dense MLP's
gate/up/down, and in mixture-of-experts layers every routed expert's
``mlp.experts.{j}.{gate,up,down}_proj`` and the shared experts' projections, each
converted to the target format (`backend/weight_formats.py`) one expert matrix at a
time. Every other tensor is copied unchanged: embeddings, norms, biases, the LM head,
the MoE router (``mlp.gate.weight`` and ``mlp.gate.e_score_correction_bias``, which
the runtime keeps in float32), and multi-token-prediction layers stored as
``model.layers.{num_hidden_layers}.*``. Those are copied, not dropped or converted:
the runtime does not run them, so a conversion could not be checked, and copying
keeps the output a complete checkpoint at the cost of one layer's bytes (1/47 of
GLM-4.5-Air). FP8 -> INT4 dequantises each FP8 weight with its block scales first,
then groups the float values. Experts stored fused, as newer transformers holds them
(``mlp.experts.gate_up_proj`` [E, 2I, H], gate rows first, and ``mlp.experts.down_proj``
[E, H, I]; dense only), are written per expert under the per-expert names, the fused
tensor read once for its experts.

Method: ``rtn`` rounds each weight to nearest on its own. ``gptq`` (INT4 only; the
default for INT4) chooses the codes against each linear's inputs on calibration text
(`--calib-tokens`, 16384, of Brown genres A-H or `--calib-file`), walking the model layer
by layer (`ops/calibration.py`, `ops/gptq.py`; GQA and MLA decoders), by default with
activation order and a clip search of each group's range (`--no-act-order`, `--no-clip`:
measured worse on SmolLM2, `BENCHMARKS.md`). `--awq` scales the inputs AWQ-style first
(`ops/awq.py`: scales searched per input, folded into the norms and up_proj's rows) and
`--refit` re-fits the group scales to the codes: neither measured better on SmolLM2's 20k
held-out tokens, so both are off. ``awq`` is the AWQ scaling followed by round to nearest.
After GPTQ, the group scales and zeros of a GQA decoder are tuned end to end against the
dense model's next-token distribution on the calibration tokens, codes fixed (`ops/scale_tune.py`;
`--tune-epochs`, 2 by default where it fits in memory, 0 off; ``awq`` and ``rtn`` are not tuned):
on SmolLM2 at g128 (GPTQ at 10% dampening, 16,384 tokens) it takes perplexity from +6.1% over FP8
to +2.8% and the KL to the dense model on held-out text from 0.074 to 0.066 (`BENCHMARKS.md`).
Every layer is then quantised before the first is written, so the whole model's INT4 weights
are held at once.
All write the same tensors, dtypes, shapes and order: the checkpoints differ only in values
(AWQ rewrites norm weights, in their dtype).
`--zero-points` writes compressed-tensors' asymmetric grid (``symmetric: false``, an
integer zero point per group, ``weight_zero_point``) instead of the symmetric one.

Streaming: the output header is planned from the input headers alone (`ops/quantize_steps.py`;
a format's tensors have known dtypes and shapes), then the tensors are written layer by layer
(tensors of no layer first), each input tensor read, converted and written before
the next, so peak memory is one tensor and its outputs; with gptq, one layer's dense
weights and the calibration hidden states [tokens, hidden] (float32) besides.
Outputs of more than `--shard-bytes` are split into shards with an index.

Atomic: everything is written into a temporary folder next to OUT, renamed to OUT
only when complete; any failure (bad input, a corrupt tensor, Ctrl-C) removes it.
OUT must not exist. Checked before anything is written, each a `WeightsError`: an
unknown input format, missing tensors (every linear, norm and embedding the config
implies; an FP8 weight's scales), an input already in the target format or in INT4,
an INT4 group size other than 32/64/128/256, an odd in_features (INT4 packs two per
byte), FP8 scales that do not cover their weight, and for gptq a calibration text
shorter than `--calib-tokens` or a model folder without a tokenizer.

The size report (`ops/quantize_report.py`) counts tensor bytes (headers excluded): input,
output, their ratio, the linear layers alone, weight bytes per GPU at tensor parallel 1 and 8,
the method, the conversion's wall seconds and the process's peak RSS.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
from tqdm import tqdm

from backend.config import ModelConfig, load_config
from backend.errors import WeightsError
from backend.gemm_pack import mem_available_bytes
from backend.weight_formats import Int4Format, WeightFormat, weight_format
from backend.weights import CheckpointReader, write_safetensors
from ops.calibration import LayerCalibrator
from ops.calibration_inputs import (DEFAULT_CALIB_TOKENS, DEFAULT_SEQ_LEN, DenseWeights, calibration_ids,
                                    in_layer_order, layer_of)
from ops.gptq import DEFAULT_DAMP
from ops.quantize_ignore import IGNORE_PRESETS, ignore_patterns
from ops.quantize_report import SizeReport, per_gpu_bytes, peak_rss_bytes, print_report, size_report
from ops.quantize_steps import ExpertSlice, QuantizePlan, Steps, plan_quantize
from ops.scale_tune import DEFAULT_TUNE_EPOCHS, DEFAULT_TUNE_LR, TunedLayers, tune_bytes, untunable

__all__ = ["register", "QuantizePlan", "ExpertSlice", "plan_quantize", "quantize_checkpoint", "per_gpu_bytes",
           "SizeReport", "METHODS", "resolve_method"]

METHODS = ("rtn", "gptq", "awq")  # awq: AWQ input scales, then round to nearest (gptq scales first by default)
GPTQ_AWQ = False  # --awq: GPTQ on AWQ-scaled weights (no better on SmolLM2 over 20,460 tokens, BENCHMARKS.md)
GPTQ_REFIT = False  # --refit: least-squares refit of each row's group scales after GPTQ
OUTPUT_FORMATS = ("compressed-tensors", "edgeserve")  # INT4 layouts --output-format writes

DEFAULT_SHARD_BYTES = 4 * 2**30
_SKIP_FILES = ("config.json", "model.safetensors.index.json")


def _produce(reader: CheckpointReader, plan: QuantizePlan, steps: Steps, done: Callable[[], object],
             weights: DenseWeights, calibrator: LayerCalibrator | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Output tensors of `steps`, one input tensor (or linear module) at a time; `done()` after each.
    With a calibrator, a layer's tensors come after its calibration (run when the first of the
    layer's tensors is due; steps are in layer order): a linear's INT4 weight from its GPTQ, a
    norm AWQ rewrote from `calibrator.tensors`."""
    layer: dict[str, object] = {}
    for key, _ in steps:
        index = layer_of(key)
        if calibrator is not None and 0 <= index < plan.cfg.num_layers:
            while calibrator.layer <= index:
                layer = calibrator.next_layer()  # the previous layer's weights are dropped here
        if key in plan.dequantized:
            yield f"{key}.weight", weights(key).to(torch.bfloat16)
        elif key not in plan.linear_modules:
            yield key, calibrator.tensors[key] if calibrator is not None and key in calibrator.tensors \
                else reader.get(key)
        else:
            if calibrator is not None:
                if key not in layer:
                    raise WeightsError(f"{key}: GPTQ calibration produced no weight for it", tensor=key)
                stored = layer.pop(key)
            else:
                stored = plan.target.quantize(weights(key))
            for suffix, tensor in stored.tensors.items():
                yield f"{key}.{suffix}", tensor
        done()


def _shards(steps: Steps, max_bytes: int) -> list[Steps]:
    """Consecutive runs of steps of at most `max_bytes` each (a step is never split)."""
    shards: list[Steps] = [[]]
    size = 0
    for step in steps:
        nbytes = sum(spec.nbytes for spec in step[1].values())
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(step)
        size += nbytes
    return shards


def _tune_epochs(asked: int | None, cfg: ModelConfig, ids: torch.Tensor, plan: QuantizePlan, progress: bool) -> int:
    """Epochs of end-to-end scale tuning: `asked`, checked (a `WeightsError` where the architecture is not
    covered or it would not fit in memory), or for None the default where it is covered and fits, else 0."""
    if asked is not None and asked < 0:
        raise WeightsError(f"--tune-epochs must be 0 or more, got {asked}")
    if asked == 0:
        return 0
    reason = untunable(cfg)
    if reason is None:
        params = sum(math.prod(plan.input_specs[f"{m}.weight"].shape) for m in plan.linear_modules
                     if f"{m}.weight" in plan.input_specs)
        need, have = tune_bytes(cfg, ids.numel(), params), mem_available_bytes()
        if have and need > have:
            reason = f"it needs about {need / 1e9:.1f} GB and {have / 1e9:.1f} GB is available"
    if reason is None:
        return DEFAULT_TUNE_EPOCHS if asked is None else asked
    if asked is not None:
        raise WeightsError(f"--tune-epochs: end-to-end scale tuning cannot run here: {reason}; use --tune-epochs 0")
    if progress:
        print(f"note: INT4 scales not tuned end to end ({reason})")
    return 0


def resolve_method(method: str | None, target: WeightFormat, cfg: ModelConfig) -> str:
    """The quantisation method: `method` checked, or for None the default (gptq for INT4 where
    calibration covers the architecture, rtn otherwise; FP8 is always rounded to nearest)."""
    if method is None:
        return "gptq" if target.name == "int4" else "rtn"
    if method not in METHODS:
        raise WeightsError(f"unknown quantisation method {method!r}; known: {', '.join(METHODS)}", method=method)
    if method != "rtn" and target.name != "int4":
        raise WeightsError(f"--method {method} quantises to INT4; {target.name} is rounded to nearest (--method rtn)",
                           method=method)
    return method


def quantize_checkpoint(src: Path, dst: Path, target: WeightFormat, *, shard_bytes: int = DEFAULT_SHARD_BYTES,
                        progress: bool = True, method: str | None = "rtn", calib_tokens: int = DEFAULT_CALIB_TOKENS,
                        calib_file: Path | None = None, calib_ids: torch.Tensor | None = None,
                        act_order: bool = True, ignore: Sequence[str] = (), damp: float = DEFAULT_DAMP,
                        static_groups: bool = False, clip: bool = True, awq: bool = GPTQ_AWQ,
                        refit: bool = GPTQ_REFIT, tune_epochs: int | None = None,
                        tune_lr: float = DEFAULT_TUNE_LR) -> SizeReport:
    """Write `dst` (which must not exist) from `src` with its linear layers in `target`; atomic.

    method: "rtn" rounds each weight to nearest; "gptq" (INT4 only) calibrates layer by layer on
    `calib_tokens` tokens of `calib_file` or Brown genres A-H (`ops/calibration.py`), or on the
    given `calib_ids` [S, L]; "awq" (INT4 only) calibrates AWQ input scales the same way, then rounds
    to nearest. GPTQ options: `awq` scales the inputs first (`ops/awq.py`), `act_order` visits
    columns by decreasing activation energy, `clip` searches each group's range, `static_groups`
    fixes the grids before any update, `refit` re-fits each row's group scales to the chosen codes,
    `damp` is the Hessian dampening (`ops/gptq.py`); `tune_epochs` tunes the group scales end to end
    against the dense model after GPTQ (`ops/scale_tune.py`; None: `DEFAULT_TUNE_EPOCHS` where the
    architecture allows it and it fits in memory, else 0); None picks the default method
    (`resolve_method`). `ignore`: linears kept dense (names or ``re:`` regexes,
    `ops/quantize_ignore.py`), besides the target's own list. Every input check, the calibration
    text's included, runs before anything is written."""
    started = time.perf_counter()
    src, dst = Path(src), Path(dst)
    if dst.exists():
        raise WeightsError(f"{dst} already exists; choose a new output folder", file=str(dst))
    cfg = load_config(src)
    reader = CheckpointReader(src, cfg.checkpoint_prefix)  # a Kimi K2.x folder: its text model only
    plan = plan_quantize(reader, cfg, target, ignore)
    method = resolve_method(method, target, cfg)
    steps = in_layer_order(plan.steps, cfg.num_layers)
    weights = DenseWeights(reader, plan)
    calibrator = None
    if method in ("gptq", "awq"):
        assert isinstance(target, Int4Format)
        seq_len = min(DEFAULT_SEQ_LEN, cfg.index_topk) if cfg.index_topk else DEFAULT_SEQ_LEN  # DSA: dense up to top-k
        ids = calib_ids if calib_ids is not None else calibration_ids(src, cfg, calib_tokens, calib_file, seq_len)
        if ids.dim() != 2 or not ids.numel() or int(ids.max()) >= cfg.vocab_size or int(ids.min()) < 0:
            raise WeightsError(f"calibration ids must be [sequences, length] in 0..{cfg.vocab_size - 1}")
        def served(module: str) -> torch.Tensor:  # what the output holds for a kept linear
            return weights(module).to(torch.bfloat16).float() if module in plan.dequantized else weights(module)

        calibrator = LayerCalibrator(cfg, ids, target, reader.get, weights, reader.__contains__, act_order,
                                     kept=plan.kept.__contains__, served=served, damp=damp,
                                     static_groups=static_groups, clip=clip, awq=awq or method == "awq",
                                     gptq=method == "gptq", refit=refit)
        epochs = _tune_epochs(tune_epochs, cfg, ids, plan, progress) if method == "gptq" else 0
        if epochs:
            calibrator = TunedLayers(calibrator, ids, epochs, tune_lr, progress)
    prefix = cfg.checkpoint_prefix  # written back under the prefix the config.json implies
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        shards = _shards(steps, shard_bytes)
        files = ["model.safetensors"] if len(shards) == 1 else \
            [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        bar = tqdm(total=len(steps), desc=f"quantize -> {target!r} ({method})", unit="tensor", disable=not progress)
        weight_map: dict[str, str] = {}
        with bar:
            for file, shard in zip(files, shards):
                specs = {prefix + name: spec for _, outs in shard for name, spec in outs.items()}
                weight_map.update(dict.fromkeys(specs, file))
                tensors = ((prefix + name, t) for name, t in _produce(reader, plan, shard, bar.update, weights,
                                                                      calibrator))
                write_safetensors(tmp / file, specs, tensors,
                                  {"edgeserve_weights": repr(target)})
        if len(files) > 1:
            total = sum(s.nbytes for s in plan.output_specs.values())
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
        raw = json.loads((src / "config.json").read_text())
        raw["quantization_config"] = target.quantization_config()
        (tmp / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
        for path in sorted(src.iterdir()):  # tokenizer, chat template, generation config ...
            if path.is_file() and not path.name.startswith(".") and path.suffix != ".safetensors" \
                    and path.name not in _SKIP_FILES:
                shutil.copy2(path, tmp / path.name)
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp made it private
        tmp.rename(dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report = size_report(plan)
    report.method = method
    report.calibration = calibrator.stats if calibrator is not None else None
    report.quantize_s = time.perf_counter() - started
    report.peak_rss_bytes = peak_rss_bytes()
    return report


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("quantize", help="convert a checkpoint's linear layers to INT4 or FP8 (streamed), "
                                               "or plan the sizes from a config (--plan)")
    p.add_argument("input", type=Path, nargs="?", help="Hugging Face folder: dense (BF16/FP16/FP32) or FP8 safetensors")
    p.add_argument("output", type=Path, nargs="?", help="new folder to write (must not exist)")
    p.add_argument("--to", required=True, choices=["int4", "fp8"], help="target format of the linear layers")
    p.add_argument("--group-size", type=int, default=128, help="INT4 group size along in_features (128; 32 allowed)")
    p.add_argument("--method", choices=METHODS, default=None,
                   help="rtn: round to nearest; gptq: calibrated (INT4 only); awq: activation-aware input scales, "
                        "then round to nearest (INT4 only). Default: gptq for int4, rtn for fp8")
    p.add_argument("--calib-tokens", type=int, default=DEFAULT_CALIB_TOKENS,
                   help=f"GPTQ calibration tokens (default {DEFAULT_CALIB_TOKENS})")
    p.add_argument("--calib-file", type=Path, default=None,
                   help="UTF-8 text to calibrate on (default: Brown corpus genres A-H)")
    p.add_argument("--act-order", action=argparse.BooleanOptionalAction, default=True,
                   help="GPTQ: quantise columns by decreasing activation energy (default on)")
    p.add_argument("--clip", action=argparse.BooleanOptionalAction, default=True,
                   help="GPTQ: search each group's range for the least weighted rounding error (default on)")
    p.add_argument("--awq", action=argparse.BooleanOptionalAction, default=GPTQ_AWQ,
                   help=f"GPTQ: search activation-aware input scales first, folded into the norms and previous "
                        f"linears (default {'on' if GPTQ_AWQ else 'off'})")
    p.add_argument("--refit", action=argparse.BooleanOptionalAction, default=GPTQ_REFIT,
                   help=f"GPTQ: least-squares refit of each row's group scales to the chosen codes "
                        f"(default {'on' if GPTQ_REFIT else 'off'})")
    p.add_argument("--tune-epochs", type=int, default=None,
                   help=f"epochs of end-to-end tuning of the INT4 group scales against the dense model after GPTQ "
                        f"(ops/scale_tune.py; default {DEFAULT_TUNE_EPOCHS} for GQA decoders where it fits in "
                        f"memory, else 0; 0 turns it off)")
    p.add_argument("--tune-lr", type=float, default=DEFAULT_TUNE_LR,
                   help=f"scale tuning's learning rate, in units of a group's scale ({DEFAULT_TUNE_LR:g})")
    p.add_argument("--zero-points", action="store_true",
                   help="compressed-tensors output: asymmetric grid with integer zero points (symmetric: false, "
                        "weight_zero_point) instead of the symmetric one Kimi ships")
    p.add_argument("--output-format", choices=OUTPUT_FORMATS, default=None,
                   help="INT4 layout: compressed-tensors pack-quantized (symmetric; vLLM/SGLang load it) or "
                        "edgeserve (asymmetric, zero points). Default: compressed-tensors when the group size "
                        "divides every quantised linear's in_features, else edgeserve")
    p.add_argument("--ignore-preset", choices=[*IGNORE_PRESETS, "none"], default="default",
                   help="linears kept out of INT4 (ops/quantize_ignore.py): default, kimi (routed experts only)")
    p.add_argument("--ignore", action="append", default=[], metavar="PATTERN",
                   help="another module name or re:<regex> to keep dense (repeatable)")
    p.add_argument("--plan", metavar="CONFIG", default=None,
                   help="print the size plan of a config.json (or folder, or known model name) and write nothing")
    p.add_argument("--tp", type=int, default=8, help="--plan: tensor parallel degree for per-GPU bytes (8)")
    p.add_argument("--plan-json", default=None, help="--plan: also write the plan as JSON here")
    p.add_argument("--shard-bytes", type=int, default=DEFAULT_SHARD_BYTES, help="largest output shard (bytes)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def int4_target(src: Path, group_size: int, output_format: str | None, ignore: Sequence[str],
                zero_points: bool = False) -> Int4Format:
    """The INT4 target for `--output-format` (None: compressed-tensors when `group_size` divides the
    in_features of every linear it would quantise, read from the headers; edgeserve otherwise);
    compressed-tensors symmetric, or with `zero_points` asymmetric."""
    if output_format is None:
        cfg = load_config(src)
        plan = plan_quantize(CheckpointReader(src, cfg.checkpoint_prefix), cfg, Int4Format(group_size), ignore)
        odd = next((m for m in sorted(plan.linear_modules) if _in_features(plan, m) % group_size), None)
        output_format = "compressed-tensors" if odd is None else "edgeserve"
        if odd is not None:
            print(f"note: {odd} has in_features {_in_features(plan, odd)}, which groups of {group_size} do not "
                  f"divide (compressed-tensors needs whole groups): writing the edgeserve INT4 layout")
    if output_format == "compressed-tensors":
        from backend.compressed_tensors_write import PackQuantizedWriter

        return PackQuantizedWriter(group_size, ignore, symmetric=not zero_points)
    return Int4Format(group_size)


def _in_features(plan: QuantizePlan, module: str) -> int:
    piece = plan.slices.get(module)
    return plan.input_specs[piece.tensor].shape[2] if piece else plan.input_specs[f"{module}.weight"].shape[1]


def run(args: argparse.Namespace) -> int:
    ignore = ignore_patterns(args.ignore_preset, args.ignore)
    if args.plan:
        from ops.quantize_plan import print_plan

        print_plan(args.plan, args.to, args.group_size, args.tp, ignore, args.plan_json,
                   scheme=(args.output_format or "compressed-tensors") + ("-zp" if args.zero_points and
                                                                            args.output_format != "edgeserve" else ""))
        return 0
    if args.input is None or args.output is None:
        raise WeightsError("edgeserve quantize needs IN and OUT folders (or --plan CONFIG)")
    target = int4_target(args.input, args.group_size, args.output_format, ignore, args.zero_points) \
        if args.to == "int4" else weight_format(args.to, args.group_size)
    report = quantize_checkpoint(args.input, args.output, target, shard_bytes=args.shard_bytes,
                                 progress=not args.no_progress, method=args.method,
                                 calib_tokens=args.calib_tokens, calib_file=args.calib_file,
                                 act_order=args.act_order, clip=args.clip, awq=args.awq, refit=args.refit,
                                 ignore=ignore, tune_epochs=args.tune_epochs, tune_lr=args.tune_lr)
    print(f"wrote {args.output}")
    print_report(report, target, load_config(args.output))
    return 0
