"""Writing compressed-tensors ``pack-quantized`` INT4 checkpoints, the layout vLLM and SGLang load.

The layout and how it is read are in `backend/compressed_tensors.py`. `PackQuantizedWriter`,
`symmetric_int4`, `pack_quantized_tensors` and `quantization_config` write the same layout, so
vLLM and SGLang load what `edgeserve quantize` writes, as they load Kimi's release. The grid is symmetric,
which our `Int4Format` grid is not (it stores a zero point per group, the value of
code 8): a pack-quantized checkpoint has no zero point, so `pack_quantized_tensors`
takes an INT4 weight whose zeros are all 0 and refuses any other. `symmetric_int4`
rounds to nearest on the grid compressed-tensors itself computes (its
`calculate_qparams` and `quantize`, read in the installed package, 0.20):

    amax  = max |W| over the group of g columns
    scale = bfloat16(amax / 7.5)      (7.5 = (q_max - q_min) / 2 = 15 / 2; an all-zero group gets
                                       bfloat16's eps, 2**-7, as the package substitutes for 0)
    q     = clamp(round_half_even(W / scale), -8, 7)

so the group's largest magnitude lands on -8 when negative and on 7 (half a step
short) when positive; 7.5 rather than 7 spends the 16th level. The quotient is
computed in the promoted dtype of W and bfloat16, as the package computes it in the
weight's dtype: on bfloat16 weights the codes and scales equal the package's bit for
bit. Scales are stored in bfloat16 as Kimi ships them (the package would keep float32
scales for a float32 model); the codes are taken against the rounded scale, so they
absorb its rounding. Against our asymmetric grid (s = (hi - lo) / 15 plus a zero
point) the symmetric step is up to 2x coarser on a group whose values are all of one
sign, and the same on a centred one; the zero point is what the asymmetric format
buys, and what a symmetric pack-quantized reader cannot take. With zero points
(``symmetric: false``, `asymmetric_int4`, `integer_zero_params`) the group's range is widened
to hold 0, scale = bfloat16((hi - lo) / 15) and an integer zp = clamp(round(-8 - lo / scale),
-8, 7) is stored per group in ``weight_zero_point`` (`pack_zero_points`); our layout holds it
as zeros = bfloat16(-zp * scale).

`weight_packed` is int32 [N, K/8] (K is a multiple of g, so of 8: nothing is padded),
`weight_scale` bfloat16 [N, K/g], and `weight_shape` int64 [2], the dtype the package
writes (`torch.tensor(weight.shape)`); readers accept any integer dtype there.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from backend.compressed_tensors import (CT_SUFFIXES, CT_ZP_SUFFIXES, PACK_QUANTIZED, int4_from_pack_quantized,
                                        pack_zero_points)
from backend.errors import WeightsError
from backend.weight_formats import CT_METHOD, INT4_GROUP_SIZES, Int4Format, StoredWeight, TensorSpec
from kernels.exact_div import div_exact

__all__ = ["symmetric_int4", "asymmetric_int4", "integer_zero_params", "pack_quantized_tensors", "quantization_config",
           "PackQuantizedWriter"]

_SYM_STEPS = 7.5  # (q_max - q_min) / 2 for int4: compressed-tensors' symmetric scale divisor
_BF16_EPS = torch.finfo(torch.bfloat16).eps  # the package's scale for an all-zero group


def _check_groups(module: str, shape: tuple[int, int], group_size: int) -> None:
    if group_size not in INT4_GROUP_SIZES:
        raise WeightsError(f"INT4 group size {group_size} is not supported; choose one of "
                           f"{', '.join(map(str, INT4_GROUP_SIZES))}", group_size=group_size)
    if len(shape) != 2 or shape[1] % group_size:
        raise WeightsError(f"{module}: a pack-quantized weight needs in_features divisible by the group size "
                           f"{group_size}; got shape {list(shape)}", tensor=f"{module}.weight", shape=list(shape))


def symmetric_int4(w: torch.Tensor, group_size: int, module: str = "weight") -> StoredWeight:
    """Round-to-nearest symmetric INT4 of `w` [N, K] on compressed-tensors' grid (module docstring),
    in the `Int4Format` layout: qweight uint8 [N, K/2] holding q + 8, scales bfloat16 [N, K/g], zeros 0."""
    if w.dim() != 2 or not w.dtype.is_floating_point:
        raise WeightsError(f"{module}: expected a 2-D float weight, got {w.dtype} {list(w.shape)}", tensor=module)
    n, k = (int(d) for d in w.shape)
    _check_groups(module, (n, k), group_size)
    dt = torch.promote_types(w.dtype, torch.bfloat16)
    groups = w.to(dt).reshape(n, k // group_size, group_size)  # [N, K/g, g]
    amax = groups.abs().amax(dim=-1).float()  # [N, K/g]
    scales = div_exact(amax, _SYM_STEPS).to(torch.bfloat16)
    scales = torch.where(scales == 0, torch.full_like(scales, _BF16_EPS), scales)
    q = (groups / scales.to(dt).unsqueeze(-1)).clamp(-8, 7).round().to(torch.int16).reshape(n, k)  # [N, K]
    codes = (q + 8).to(torch.uint8)
    qweight = codes[:, 0::2] | (codes[:, 1::2] << 4)  # [N, K/2]: column 2j low nibble, 2j + 1 high
    return StoredWeight({"qweight": qweight.contiguous(), "scales": scales.contiguous(),
                         "zeros": torch.zeros_like(scales)}, (n, k))


def integer_zero_params(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zp) float32 of groups with minimum `lo` and maximum `hi` on compressed-tensors' asymmetric
    grid: the range widened to hold 0, scale = bfloat16((hi - lo) / 15) (eps for an all-zero group),
    zp = clamp(round(-8 - lo / scale), -8, 7) (module docstring)."""
    lo, hi = lo.float().clamp(max=0), hi.float().clamp(min=0)
    scale = div_exact(hi - lo, 15.0).to(torch.bfloat16)
    scale = torch.where(scale == 0, torch.full_like(scale, _BF16_EPS), scale).float()
    return scale, torch.round(-8 - lo / scale).clamp(-8, 7)


def asymmetric_int4(w: torch.Tensor, group_size: int, module: str = "weight") -> StoredWeight:
    """Round-to-nearest INT4 of `w` [N, K] on compressed-tensors' asymmetric grid (`integer_zero_params`),
    in the `Int4Format` layout: codes q + 8 = clamp(round((w - z) / scale) + 8, 0, 15) against
    z = bfloat16(-zp * scale), the zeros our runtime adds (module docstring)."""
    if w.dim() != 2 or not w.dtype.is_floating_point:
        raise WeightsError(f"{module}: expected a 2-D float weight, got {w.dtype} {list(w.shape)}", tensor=module)
    n, k = (int(d) for d in w.shape)
    _check_groups(module, (n, k), group_size)
    groups = w.float().reshape(n, k // group_size, group_size)  # [N, K/g, g]
    scale, zp = integer_zero_params(groups.amin(dim=-1), groups.amax(dim=-1))  # [N, K/g]
    zeros = (-zp * scale).to(torch.bfloat16)
    codes = (torch.round((groups - zeros.float().unsqueeze(-1)) / scale.unsqueeze(-1)) + 8).clamp(0, 15)
    codes = codes.to(torch.uint8).reshape(n, k)
    qweight = codes[:, 0::2] | (codes[:, 1::2] << 4)  # [N, K/2]
    return StoredWeight({"qweight": qweight.contiguous(), "scales": scale.to(torch.bfloat16), "zeros": zeros},
                        (n, k))


def pack_quantized_tensors(module: str, int4: StoredWeight, symmetric: bool = True) -> dict[str, torch.Tensor]:
    """`<module>.weight_packed` int32 [N, K/8], `.weight_scale` bfloat16 [N, K/g] and `.weight_shape`
    int64 [2] of a symmetric `Int4Format` weight (zeros all 0, as `symmetric_int4` or a symmetric GPTQ
    gives): the same bits, eight codes per little-endian word. The group size is read off the scales.
    Not `symmetric`: zeros must be bfloat16(-zp * scale) for integers zp in -8..7 (`asymmetric_int4`,
    an integer-zero GPTQ), written as `.weight_zero_point` int32 [ceil(N/8), K/g] (`pack_zero_points`)."""
    t, (n, k) = int4.tensors, int4.shape
    q, scales, zeros = t["qweight"], t["scales"], t["zeros"]
    if q.dtype != torch.uint8 or tuple(q.shape) != (n, k // 2) or scales.dim() != 2 or scales.shape[0] != n \
            or not scales.shape[1] or k % scales.shape[1] or tuple(zeros.shape) != tuple(scales.shape):
        raise WeightsError(f"{module}: not an INT4 weight of shape [{n}, {k}]: qweight {q.dtype} {list(q.shape)}, "
                           f"scales {list(scales.shape)}, zeros {list(zeros.shape)}", tensor=module)
    _check_groups(module, (n, k), k // scales.shape[1])
    extra: dict[str, torch.Tensor] = {}
    if not symmetric:
        zp = torch.round(-zeros.float() / scales.float())
        if zp.min() < -8 or zp.max() > 7 or not torch.equal((-zp * scales.float()).to(torch.bfloat16),
                                                              zeros.to(torch.bfloat16)):
            raise WeightsError(f"{module}: the INT4 weight's zeros are not -zp * scale for integers zp in -8..7; "
                               f"quantise with asymmetric_int4 (or an integer-zero GPTQ)", tensor=f"{module}.zeros")
        extra[f"{module}.weight_zero_point"] = pack_zero_points(zp)
    elif zeros.any():
        raise WeightsError(f"{module}: the INT4 weight has nonzero zero points (an asymmetric grid); pack-quantized "
                           f"stores a symmetric one: quantise with symmetric_int4 (or a symmetric GPTQ)",
                           tensor=f"{module}.zeros")
    packed = q.contiguous().view(n, k // 8, 4)  # a word's four bytes, low byte first
    if sys.byteorder == "big":
        packed = packed.flip(-1)
    return {f"{module}.weight_packed": packed.contiguous().view(torch.int32).reshape(n, k // 8),
            f"{module}.weight_scale": scales.to(torch.bfloat16).contiguous(),
            f"{module}.weight_shape": torch.tensor([n, k], dtype=torch.int64), **extra}


def quantization_config(group_size: int, ignore: Sequence[str], actorder: str | None = None,
                        symmetric: bool = True) -> dict[str, Any]:
    """config.json's `quantization_config` for a pack-quantized W4A16 checkpoint: one config group
    targeting every Linear, int4 in groups of `group_size` (symmetric, or with zero points), minus the
    `ignore` list (names or ``re:`` regexes). `actorder` "weight" records a static activation order (no g_idx)."""
    if actorder not in (None, "weight"):
        raise WeightsError(f"actorder {actorder!r} is not supported: None, or 'weight' (no g_idx is stored)",
                           actorder=actorder)
    _check_groups("quantization_config", (0, 0), group_size)
    weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": group_size, "symmetric": symmetric,
               "dynamic": False, "actorder": actorder}
    return {"quant_method": CT_METHOD, "format": PACK_QUANTIZED, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None, "format": PACK_QUANTIZED}},
            "ignore": list(ignore), "kv_cache_scheme": None, "sparsity_config": {}, "transform_config": {}}


class PackQuantizedWriter(Int4Format):
    """The INT4 target `edgeserve quantize` writes as compressed-tensors pack-quantized: `quantize`
    rounds to `symmetric_int4` (or, not `symmetric`, `asymmetric_int4`) and packs; `specs` and
    `quantization_config` describe the output. Its stored tensors are the pack-quantized ones; `read`
    (and `unpack`) turns them into the `Int4Format` layout, the one the inherited runtime methods
    (`linear`, `cat_rows`, `permute_rows`) take; `dequantize` takes either."""

    def __init__(self, group_size: int = 32, ignore: Sequence[str] = (), symmetric: bool = True) -> None:
        super().__init__(group_size)
        self.ignore, self.symmetric = tuple(ignore), symmetric
        self.suffixes = CT_SUFFIXES if symmetric else CT_ZP_SUFFIXES

    def __repr__(self) -> str:
        kind = "" if self.symmetric else ", zero points"
        return f"int4(g{self.group_size}, compressed-tensors pack-quantized{kind})"

    def specs(self, shape: tuple[int, int]) -> dict[str, TensorSpec]:
        n, k = shape
        _check_groups("weight", (n, k), self.group_size)
        specs = {"weight_packed": TensorSpec(torch.int32, (n, k // 8)),
                 "weight_scale": TensorSpec(torch.bfloat16, (n, k // self.group_size)),
                 "weight_shape": TensorSpec(torch.int64, (2,))}
        if not self.symmetric:
            specs["weight_zero_point"] = TensorSpec(torch.int32, (-(-n // 8), k // self.group_size))
        return specs

    def quantize(self, w: torch.Tensor) -> StoredWeight:
        rtn = symmetric_int4 if self.symmetric else asymmetric_int4
        return self.pack(rtn(w, self.group_size))

    def pack(self, int4: StoredWeight, module: str = "weight") -> StoredWeight:
        """An `Int4Format` weight on this writer's grid (a GPTQ result, say) as this format's stored tensors."""
        if int4.tensors["scales"].shape[-1] * self.group_size != int4.shape[1]:
            raise WeightsError(f"{module}: scales {list(int4.tensors['scales'].shape)} are not groups of "
                               f"{self.group_size} over in_features {int4.shape[1]}", tensor=module)
        out = pack_quantized_tensors(module, int4, self.symmetric)
        return StoredWeight({s: out[f"{module}.{s}"] for s in self.suffixes}, int4.shape)

    def unpack(self, sw: StoredWeight, module: str = "weight") -> StoredWeight:
        """This format's stored tensors back in the `Int4Format` layout (the same codes and scales)."""
        t = sw.tensors
        return int4_from_pack_quantized(t["weight_packed"], t["weight_scale"], t["weight_shape"], self.group_size,
                                        module, t.get("weight_zero_point"))

    def read(self, get: Callable[[str], torch.Tensor], module: str) -> StoredWeight:
        return self.unpack(StoredWeight({s: get(f"{module}.{s}") for s in self.suffixes}, (0, 0)), module)

    def dequantize(self, sw: StoredWeight) -> torch.Tensor:
        return super().dequantize(sw if "qweight" in sw.tensors else self.unpack(sw))

    def quantization_config(self) -> dict[str, Any]:
        return quantization_config(self.group_size, self.ignore, symmetric=self.symmetric)
