"""The conversion plan of `edgeserve quantize`: every output tensor, in order, from the input headers alone.

`plan_quantize` checks the input (its format, the tensors the architecture's layout needs, an
FP8 weight's scales, shapes INT4 can pack) and lists the output tensors step by step, one step
per input tensor or linear module in checkpoint order, before any data is read: the writer
(`ops/quantize.py`) streams them in that order and the size report counts them. Linears an
ignore list names stay dense (an FP8 one dequantised to BF16); routed experts stored fused
(``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]) are planned per
expert, as `ExpertSlice`s of the fused tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from backend.config import ModelConfig
from backend.errors import WeightsError
from backend.models.checkpoint_layout import checkpoint_layout
from backend.weight_formats import TensorSpec, WeightFormat, stored_format
from backend.weights import CheckpointReader
from ops.quantize_ignore import ignore_matcher, validate_patterns

__all__ = ["Steps", "ExpertSlice", "QuantizePlan", "plan_quantize"]

Steps = list[tuple[str, dict[str, TensorSpec]]]  # (input tensor or linear module, its output tensors) in file order


class ExpertSlice(NamedTuple):
    """One expert's projection inside a fused experts tensor: ``tensor[expert, start:stop]``."""

    tensor: str  # `<layer>.mlp.experts.gate_up_proj` [E, 2I, H] or `.down_proj` [E, H, I]
    expert: int
    start: int
    stop: int


@dataclass
class QuantizePlan:
    """What will be written: output tensors in order, grouped by the input tensor they come from."""

    cfg: ModelConfig
    source: WeightFormat | None  # None: dense input
    target: WeightFormat
    steps: Steps = field(default_factory=list)
    input_specs: dict[str, TensorSpec] = field(default_factory=dict)
    linear_modules: set[str] = field(default_factory=set)
    slices: dict[str, ExpertSlice] = field(default_factory=dict)  # module -> where a fused input holds it
    kept: set[str] = field(default_factory=set)  # linears the ignore list keeps dense (as stored, FP8 -> BF16)
    dequantized: set[str] = field(default_factory=set)  # kept linears stored FP8, written as a BF16 .weight

    @property
    def output_specs(self) -> dict[str, TensorSpec]:
        return {name: spec for _, outs in self.steps for name, spec in outs.items()}


def _fused_expert(module: str, cfg: ModelConfig, specs: dict[str, TensorSpec]) -> ExpertSlice | None:
    """Where a dense checkpoint with fused experts holds routed expert `module`
    (`<layer>.mlp.experts.{j}.{gate,up,down}_proj`), if it does; shapes checked."""
    head, sep, tail = module.partition(".mlp.experts.")
    if not sep:
        return None
    j, proj = tail.split(".")
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    name, shape = (f"{head}.mlp.experts.down_proj", (e, h, i)) if proj == "down_proj" else \
        (f"{head}.mlp.experts.gate_up_proj", (e, 2 * i, h))
    if name not in specs:
        return None
    if specs[name].shape != shape:
        raise WeightsError(f"{name} has shape {list(specs[name].shape)}, the config needs {list(shape)}", tensor=name)
    start = i if proj == "up_proj" else 0  # gate rows first, then up
    return ExpertSlice(name, int(j), start, start + (h if proj == "down_proj" else i))


def plan_quantize(reader: CheckpointReader, cfg: ModelConfig, target: WeightFormat,
                  ignore: Sequence[str] = ()) -> QuantizePlan:
    """Check the input and plan every output tensor from the headers alone (no data read). Linears
    named by `ignore` (or the target's own ignore list) stay dense (see the module docstring)."""
    patterns = validate_patterns([*ignore, *getattr(target, "ignore", ())])
    ignored = ignore_matcher(patterns, cfg.checkpoint_prefix) if patterns else (lambda module: False)
    source = stored_format(cfg.quantization, cfg.checkpoint_prefix)
    if source is not None and source.name == "int4":
        raise WeightsError("the input is already INT4; quantize reads dense (BF16/FP16/FP32) or FP8 checkpoints")
    if source is not None and source.name == target.name:
        raise WeightsError(f"the input is already {target.name}; nothing to convert")
    names = set(reader.names())
    layout = checkpoint_layout(cfg)
    for name in layout.required:
        if name not in names:
            raise WeightsError(f"tensor {name!r} is missing from the checkpoint at {reader.model_dir}", tensor=name)
    plan = QuantizePlan(cfg, source, target, input_specs={n: reader.spec(n) for n in reader.names()})
    consumed: dict[str, str] = {}  # input tensor -> module it belongs to
    fused: dict[str, list[str]] = {}  # fused experts tensor -> the modules it holds, in order
    for module in layout.linears:
        piece = None
        if source is None and f"{module}.weight" not in names:
            piece = _fused_expert(module, cfg, plan.input_specs)
        if ignored(module):
            if piece is not None:
                raise WeightsError(f"{module} is stored inside the fused {piece.tensor}; the ignore list can keep "
                                   f"a fused experts tensor dense only whole (name every expert, or none)",
                                   tensor=piece.tensor)
            plan.kept.add(module)
            if f"{module}.weight" not in names:
                raise WeightsError(f"tensor {module}.weight is missing from the checkpoint at {reader.model_dir}",
                                   tensor=f"{module}.weight")
            if source is not None:  # an FP8 linear kept: dequantised to a BF16 .weight (what loaders read dense)
                plan.dequantized.add(module)
                for suffix in source.suffixes:
                    consumed[f"{module}.{suffix}"] = module
            continue
        if piece is not None:
            spec = plan.input_specs[piece.tensor]
            if not spec.dtype.is_floating_point or spec.dtype.itemsize < 2:
                raise WeightsError(f"{piece.tensor} is {spec.dtype}; fused experts are read dense only",
                                   tensor=piece.tensor)
            plan.slices[module] = piece
            fused.setdefault(piece.tensor, []).append(module)
            plan.linear_modules.add(module)
            continue
        suffixes = source.suffixes if source is not None else ("weight",)
        for suffix in suffixes:
            if f"{module}.{suffix}" not in names:
                raise WeightsError(f"tensor {module}.{suffix!s} is missing from the checkpoint at "
                                   f"{reader.model_dir}", tensor=f"{module}.{suffix}")
            consumed[f"{module}.{suffix}"] = module
        spec = plan.input_specs[f"{module}.weight"]
        if len(spec.shape) != 2:
            raise WeightsError(f"{module}.weight must be 2-D, got shape {list(spec.shape)}", tensor=f"{module}.weight")
        if source is None and (not spec.dtype.is_floating_point or spec.dtype.itemsize < 2):
            raise WeightsError(f"{module}.weight is {spec.dtype}, but config.json declares no quantization_config; "
                               f"known input formats: dense (bf16/fp16/fp32), fp8", tensor=f"{module}.weight")
        if source is not None:  # the stored scales must cover the weight
            stored = {s: plan.input_specs[f"{module}.{s}"] for s in source.suffixes}
            if stored != source.specs((spec.shape[0], spec.shape[1])):
                raise WeightsError(f"{module}: tensors {stored} do not fit {source!r} for a {list(spec.shape)} weight",
                                   tensor=module)
        if target.name == "int4" and spec.shape[1] % 2:
            raise WeightsError(f"{module}.weight: INT4 packs two codes per byte, so in_features must be even; "
                               f"got {list(spec.shape)}", tensor=f"{module}.weight")
        plan.linear_modules.add(module)
    for name in reader.names():  # checkpoint order; a module's outputs go where its .weight is
        module = consumed.get(name)
        if name in fused:  # each expert's outputs, where the fused tensor was
            for module in fused[name]:
                piece = plan.slices[module]
                outs = target.specs((piece.stop - piece.start, plan.input_specs[name].shape[2]))
                plan.steps.append((module, {f"{module}.{s}": spec for s, spec in outs.items()}))
        elif module is None:
            plan.steps.append((name, {name: plan.input_specs[name]}))
        elif name == f"{module}.weight":
            shape = plan.input_specs[name].shape
            outs = {"weight": TensorSpec(torch.bfloat16, shape)} if module in plan.dequantized else \
                target.specs((shape[0], shape[1]))
            plan.steps.append((module, {f"{module}.{s}": spec for s, spec in outs.items()}))
    return plan
