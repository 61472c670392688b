"""compressed-tensors ``pack-quantized`` INT4 checkpoints (Kimi K2-Thinking / K2.5 / K2.6): read into INT4, and written.

Kimi's native INT4 checkpoints come out of quantisation-aware training and are written
by the `compressed-tensors` package. config.json (top level, or inside `text_config`)::

    "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
      "quantization_status": "compressed",
      "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": null,
        "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32,
                    "symmetric": true, "dynamic": false, "actorder": null}}},
      "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                 "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]}

so only the routed experts are INT4 (W4A16); attention, the shared experts and the
dense first layers stay BF16. A quantised linear `<m>` [N, K] is stored as

    <m>.weight_packed  int32     [N, ceil(K/8)]  eight 4-bit codes per word along K, LSB first:
                                                 column 8j + i in bits 4i..4i+3 of word j
    <m>.weight_scale   bfloat16  [N, K/g]        one scale per group of g = 32 columns
    <m>.weight_shape   int64     [2]             (N, K)

with codes c = q + 8 for the signed q in -8..7 and no zero point (symmetric):
W[n, k] = q[n, k] * weight_scale[n, k // g].

**Into the project's INT4 format** (`weight_formats.Int4Format`: ``qweight`` uint8
[N, K/2] with column 2j in the low nibble of byte j, W = (c - 8) * scales + zeros) the
bits move as they are: a little-endian int32 word's bytes are its nibble pairs in
column order, so ``qweight`` is ``weight_packed`` viewed as bytes (the first K/2 of
each row; a big-endian host flips each word's bytes first). The codes are the same
c = q + 8, ``scales`` is ``weight_scale`` (bfloat16 as Kimi ships it; float16 or
float32 scales are rounded to bfloat16, a relative change <= 2**-9 of the scale with
the codes untouched) and ``zeros`` is 0. No weight passes through a float value, and
the group size stays the checkpoint's (32 for Kimi), so the INT4 GEMM runs the
stored grid exactly.

Which modules are quantised follows the config as compressed-tensors matches it: a
module named in `ignore` (exactly, or by ``re:`` regex with `re.match`) is read dense
from ``<m>.weight``; otherwise a config group whose `targets` match it (the class
target ``Linear`` matches every linear; names and ``re:`` regexes as for `ignore`)
says it is packed. Names are matched with and without the checkpoint's prefix
(``language_model.`` for Kimi K2.5/K2.6), as a config may spell either. A module the
config quantises but the checkpoint stores only as ``<m>.weight`` is read dense.

A tensor-parallel rank reads its rows, or its whole groups of columns, of a packed linear
(`backend/distributed/weight_slices.py`).

Refused with `WeightsError` (naming the tensor, or the config entry): another
`format` (naive-quantized, float-quantized, nvfp4, ...), weights other than
symmetric 4-bit int group-wise, quantised activations, group-wise activation
ordering (``actorder: group``, which stores a ``g_idx``), config groups with
different group sizes, sparsity or transform configs, a ``weight_shape`` that
disagrees with the packed or scale tensors, a K the group size does not divide,
and a packed tensor for an ignored module.

**Writing** (`PackQuantizedWriter`, `symmetric_int4`, `asymmetric_int4`, `pack_quantized_tensors`,
`quantization_config`) is in `backend/compressed_tensors_write.py`; its names are also reachable
from this module, as they were before it was split off.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from backend.errors import WeightsError
from backend.weight_formats import INT4_GROUP_SIZES, Int4Format, StoredWeight

__all__ = ["CT_SUFFIXES", "CT_ZP_SUFFIXES", "PACK_QUANTIZED", "CompressedTensorsInt4", "CompressedTensorsZeroPointInt4",
           "compressed_tensors_format", "int4_from_pack_quantized", "matches_any", "pack_zero_points",
           "unpack_zero_points"]

CT_SUFFIXES = ("weight_packed", "weight_scale", "weight_shape")  # checkpoint tensors of one packed linear
CT_ZP_SUFFIXES = (*CT_SUFFIXES, "weight_zero_point")  # ... of an asymmetric one
PACK_QUANTIZED = "pack-quantized"  # the only compressed-tensors format read and written


def matches_any(name: str, patterns: Sequence[str]) -> bool:
    """compressed-tensors' name match: ``re:<regex>`` by `re.match`, anything else exactly."""
    return any(re.match(p[3:], name) is not None if p.startswith("re:") else p == name for p in patterns)


class _PackQuantizedConfig(Int4Format):
    """What both pack-quantized readers share: `targets` and `ignore` say which modules are packed."""

    def __init__(self, group_size: int, targets: Sequence[str], ignore: Sequence[str], prefix: str = "") -> None:
        super().__init__(group_size)
        self.targets, self.ignore, self.prefix = tuple(targets), tuple(ignore), prefix

    def quantizes(self, module: str) -> bool:
        """Whether the config packs linear `module` (named without the checkpoint prefix)."""
        names = (module, self.prefix + module) if self.prefix else (module,)
        if any(matches_any(n, self.ignore) for n in names):
            return False
        return "Linear" in self.targets or any(matches_any(n, self.targets) for n in names)

    def stores_dense(self, module: str, contains: Callable[[str], bool]) -> bool:
        packed = contains(f"{module}.weight_packed")
        if not self.quantizes(module):
            if packed:
                raise WeightsError(f"{module}.weight_packed is stored, but quantization_config's ignore list or "
                                   f"targets leave {module} dense", tensor=f"{module}.weight_packed")
            return True
        return not packed and contains(f"{module}.weight")



class CompressedTensorsInt4(_PackQuantizedConfig):
    """The INT4 format (`Int4Format`: runtime tensors, GEMM, fusing) read from a symmetric compressed-tensors
    pack-quantized checkpoint (Kimi's)."""

    def read(self, get: Callable[[str], torch.Tensor], module: str) -> StoredWeight:
        packed, scale, shape = (get(f"{module}.{s}") for s in CT_SUFFIXES)
        return int4_from_pack_quantized(packed, scale, shape, self.group_size, module)


class CompressedTensorsZeroPointInt4(_PackQuantizedConfig):
    """The INT4 format read from an asymmetric (``symmetric: false``) pack-quantized checkpoint: each
    group's integer zero point (``weight_zero_point``) becomes our zeros = bfloat16(-zp * scale)."""

    def read(self, get: Callable[[str], torch.Tensor], module: str) -> StoredWeight:
        packed, scale, shape, zero = (get(f"{module}.{s}") for s in CT_ZP_SUFFIXES)
        return int4_from_pack_quantized(packed, scale, shape, self.group_size, module, zero)


def int4_from_pack_quantized(packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor, group_size: int,
                             module: str, zero_point: torch.Tensor | None = None) -> StoredWeight:
    """One pack-quantized linear (weight_packed int32 [N, ceil(K/8)], weight_scale [N, K/g],
    weight_shape [2], and for an asymmetric one weight_zero_point int32 [ceil(N/8), K/g]) as an
    `Int4Format` weight {qweight [N, K/2] uint8, scales, zeros [N, K/g] bfloat16}: the same bits and
    codes; zeros 0, or bfloat16(-zp * scale) (see the module docstring)."""
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise WeightsError(f"{module}.weight_packed must be 2-D int32, got {packed.dtype} {list(packed.shape)}",
                           tensor=f"{module}.weight_packed")
    if shape.dim() != 1 or shape.numel() != 2 or shape.dtype.is_floating_point:
        raise WeightsError(f"{module}.weight_shape must hold the two ints [out, in], got {shape.dtype} "
                           f"{list(shape.shape)}", tensor=f"{module}.weight_shape")
    n, k = (int(v) for v in shape.tolist())
    if (n, -(-k // 8)) != tuple(packed.shape):
        raise WeightsError(f"{module}.weight_shape says [{n}, {k}], which packs eight per int32 into "
                           f"[{n}, {-(-k // 8)}], but weight_packed is {list(packed.shape)}",
                           tensor=f"{module}.weight_shape")
    if k % group_size:
        raise WeightsError(f"{module}: in_features {k} is not a multiple of the group size {group_size}",
                           tensor=f"{module}.weight_shape")
    if not scale.dtype.is_floating_point or tuple(scale.shape) != (n, k // group_size):
        raise WeightsError(f"{module}.weight_scale is {scale.dtype} {list(scale.shape)}; a [{n}, {k}] weight in "
                           f"groups of {group_size} needs float [{n}, {k // group_size}]",
                           tensor=f"{module}.weight_scale")
    qweight = packed.contiguous().view(torch.uint8)  # [N, 4 * ceil(K/8)]: a word's bytes, low byte first
    if sys.byteorder == "big":
        qweight = qweight.view(n, -1, 4).flip(-1).reshape(n, -1)
    scales = scale.to(torch.bfloat16).contiguous()  # [N, K/g]
    zeros = torch.zeros_like(scales)
    if zero_point is not None:
        zeros = (-unpack_zero_points(zero_point, n, module).float() * scales.float()).to(torch.bfloat16)
        if zeros.shape != scales.shape:
            raise WeightsError(f"{module}.weight_zero_point holds {list(zeros.shape)} zero points; weight_scale is "
                               f"{list(scales.shape)}", tensor=f"{module}.weight_zero_point")
    return StoredWeight({"qweight": qweight[:, : k // 2].contiguous(), "scales": scales, "zeros": zeros}, (n, k))


def pack_zero_points(zp: torch.Tensor) -> torch.Tensor:
    """Integer zero points zp [N, G] in -8..7 packed as compressed-tensors packs them, along N: int32
    [ceil(N/8), G], rows 8i..8i+7 of a column in bits 0..31 of word i as 4-bit zp + 8 (rows past N 0)."""
    n, groups = zp.shape
    codes = torch.zeros(groups, -(-n // 8) * 8, dtype=torch.uint8)  # [G, N padded]
    codes[:, :n] = (zp.to(torch.int16) + 8).to(torch.uint8).t()
    pairs = codes[:, 0::2] | (codes[:, 1::2] << 4)  # [G, N/2]: row 2j low nibble, 2j + 1 high
    words = pairs.view(groups, -1, 4)
    if sys.byteorder == "big":
        words = words.flip(-1)
    packed = words.contiguous().view(torch.int32).reshape(groups, -1)  # [G, N/8]
    return torch.empty(packed.shape[1], groups, dtype=torch.int32).copy_(packed.t())  # [N/8, G], row-major strides


def unpack_zero_points(packed: torch.Tensor, n: int, module: str = "weight") -> torch.Tensor:
    """`pack_zero_points`' inverse: int32 [ceil(N/8), G] -> zp int16 [N, G] in -8..7."""
    if packed.dtype != torch.int32 or packed.dim() != 2 or packed.shape[0] != -(-n // 8):
        raise WeightsError(f"{module}.weight_zero_point must be int32 [ceil({n}/8), groups], got {packed.dtype} "
                           f"{list(packed.shape)}", tensor=f"{module}.weight_zero_point")
    by_group = torch.empty(packed.shape[1], packed.shape[0], dtype=torch.int32).copy_(packed.t())  # [G, N/8]
    words = by_group.view(torch.uint8).view(packed.shape[1], -1, 4)  # [G, N/8, 4] (a one-word [G, 1] too)
    if sys.byteorder == "big":
        words = words.flip(-1)
    pairs = words.reshape(packed.shape[1], -1)  # [G, N/2]
    codes = torch.stack([pairs & 15, pairs >> 4], dim=-1).reshape(packed.shape[1], -1)[:, :n]  # [G, N]
    return (codes.to(torch.int16) - 8).t().contiguous()


def _check_group(name: str, group: dict[str, Any], default_format: str | None) -> tuple[int, bool]:
    """(group size, symmetric) of config group `name`, after checking it is 4-bit int group-wise W4A16."""
    fmt = group.get("format") or default_format
    if fmt != PACK_QUANTIZED:
        raise WeightsError(f"compressed-tensors format {fmt!r} (config group {name!r}) is not supported; "
                           f"supported: {PACK_QUANTIZED!r} (INT4 W4A16)", config_group=name)
    w = group.get("weights") or {}
    symmetric = w.get("symmetric", True) is not False
    want = {"num_bits": 4, "type": "int", "strategy": "group", "symmetric": symmetric}
    got = {key: w.get(key, True) if key == "symmetric" else w.get(key) for key in want}
    if got != want or w.get("dynamic") not in (False, None) or w.get("actorder") not in (None, False, "weight") \
            or group.get("input_activations") is not None:
        raise WeightsError(f"compressed-tensors config group {name!r} is not supported: weights {w}, "
                           f"input_activations {group.get('input_activations')}; supported: {want}, static, "
                           f"no group activation ordering, input_activations null (W4A16)", config_group=name)
    size = w.get("group_size")
    if size not in INT4_GROUP_SIZES:
        raise WeightsError(f"compressed-tensors config group {name!r} has group_size {size!r}; supported: "
                           f"{', '.join(map(str, INT4_GROUP_SIZES))}", config_group=name)
    return int(size), symmetric


def compressed_tensors_format(qc: dict[str, Any], prefix: str = "") -> _PackQuantizedConfig:
    """The format of a `quant_method: compressed-tensors` config (checked; see the module docstring)."""
    status = qc.get("quantization_status", "compressed")
    groups = qc.get("config_groups") or {}
    if status != "compressed" or not isinstance(groups, dict) or not groups:
        raise WeightsError(f"compressed-tensors checkpoint with quantization_status {status!r} and config_groups "
                           f"{groups!r}; supported: compressed weights with at least one config group",
                           quantization_config=qc)
    for extra in ("sparsity_config", "transform_config"):
        if qc.get(extra):
            raise WeightsError(f"compressed-tensors {extra} {qc[extra]!r} is not supported (only dense INT4 weights "
                               f"with no transforms)", quantization_config=qc)
    schemes = {_check_group(name, group, qc.get("format")) for name, group in groups.items()}
    if len(schemes) > 1:
        raise WeightsError(f"compressed-tensors config groups use (group size, symmetric) {sorted(schemes)}; one "
                           f"scheme per checkpoint is supported", quantization_config=qc)
    targets = [t for group in groups.values() for t in group.get("targets") or []]
    size, symmetric = schemes.pop()
    cls = CompressedTensorsInt4 if symmetric else CompressedTensorsZeroPointInt4
    return cls(size, targets, list(qc.get("ignore") or []), prefix)


_WRITER = ("symmetric_int4", "asymmetric_int4", "integer_zero_params", "pack_quantized_tensors", "quantization_config",
           "PackQuantizedWriter")  # defined in backend/compressed_tensors_write.py (which imports this module)


def __getattr__(name: str) -> Any:
    """The writer's names, looked up in their own module on first use (PEP 562: no import cycle)."""
    if name in _WRITER:
        from backend import compressed_tensors_write

        return getattr(compressed_tensors_write, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
