"""Weight formats of the linear layers: dense, FP8 with block scales, INT4 group-wise.

A format says how one linear weight W [N, K] (N = out_features, K = in_features)
is stored in a checkpoint, how it is dequantised, and which GEMM runs it.
`weight_format(name, group_size)` is the one place a name becomes a format, and
`stored_format(config)` the one place a checkpoint's config.json names its format
(compressed-tensors ``pack-quantized`` INT4, as Kimi K2-Thinking/K2.5/K2.6 ship, is
read into the INT4 format below by `backend/compressed_tensors.py`).

    format  tensors stored for a linear `<m>` (e.g. model.layers.0.mlp.down_proj)   bytes per weight
    fp32    <m>.weight            float32        [N, K]                              4
    bf16    <m>.weight            bfloat16       [N, K]                              2
    fp8     <m>.weight            float8_e4m3fn  [N, K]                              1 + 4 / 128^2
            <m>.weight_scale_inv  float32        [ceil(N/128), ceil(K/128)]
    int4    <m>.qweight           uint8          [N, K/2]                            0.5 + 4 / g
            <m>.scales            bfloat16       [N, ceil(K/g)]
            <m>.zeros             bfloat16       [N, ceil(K/g)]

**FP8** is the layout of the large public FP8 checkpoints (DeepSeek-V3, Qwen3-FP8):
e4m3 values (max 448, 3 mantissa bits) and one float32 scale per 128 x 128 block,

    W[n, k] = float(q[n, k]) * weight_scale_inv[n // 128, k // 128]

(despite its name, `weight_scale_inv` multiplies). Quantising a block: s = amax / 448
(1 for an all-zero block), q = e4m3(clamp(W / s, -448, 448)), rounded to nearest
even; every element keeps a relative error <= 2**-4. Edge blocks are partial (a
[300, 200] weight has [3, 2] scales). config.json: ``"quantization_config":
{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"weight_block_size": [128, 128]}``, plus ``"scale_fmt": "ue8m0"`` in newer DeepSeek
releases: power-of-two scales, stored as float32 or ``float8_e8m0fnu`` (F8_E8M0), read
as float32 and multiplied the same way; quantising rounds s up to a power of two.

**INT4** is asymmetric and group-wise along K, with g = 128 by default (32 allowed):

    W[n, k] = (q[n, k] - 8) * scales[n, k // g] + zeros[n, k // g],    q in 0..15

packed two per byte along K (so K must be even): ``qweight[n, j]`` holds column 2j in
its low nibble and 2j + 1 in its high nibble. ``zeros`` is the
value the midpoint code 8 stands for: the convention of torch's CPU INT4 GEMM, so the
stored scales and zeros feed it unchanged. Quantising a group with minimum lo and
maximum hi: s = (hi - lo) / 15 and z = lo + 8 s are rounded to bfloat16 first, then
q = clamp(round((W - z) / s) + 8, 0, 15) against the rounded s and z, so the codes
absorb the rounding of the scales. A K that is not a multiple of g ends each row
with a partial group (SmolLM2's hidden size is 576 = 4 x 128 + 64): strict
divisibility would rule out the default g = 128 on the default model. Asymmetric
because a group's weights are rarely centred; for SmolLM2 in particular the source
weights are llama.cpp's Q4_1 (asymmetric, 32 along K), which INT4 g32 reproduces.
config.json: ``"quantization_config": {"quant_method": "edgeserve_int4", "bits": 4,
"group_size": g, "zero_point": "midpoint_value", "packing": "uint8_low_nibble_first"}``.

What is quantised: every 2-D ``*_proj.weight`` under ``model.layers.`` (attention
q/k/v/o, MLP gate/up/down). Embeddings, norms, biases and the LM head (tied to the
embedding in SmolLM2) keep the checkpoint's dense dtype; `BENCHMARKS.md` has what
quantising the LM head would buy and cost.

Runtime (the GEMM each format runs; measurements in `BENCHMARKS.md`, weights section):
- fp32, bf16: a dense GEMM in the weight's dtype (activations cast to it and back);
  float32 weights use the MKL-packed buckets of `linear.py`.
- fp8 on CPU: dequantised at load into the compute dtype, so it runs (and costs in
  memory) what the dense compute-dtype GEMM does. The CPU has no FP8 GEMM, and
  dequantising per call would add a pass over every weight to every step. On CUDA:
  the Triton W8A16 kernel (`kernels/fp8_gemm.py`), scales applied in registers.
- int4 on CPU with AVX512-BF16 or AVX2: the C kernel of `kernels/cpu_gemv_int4.py` on
  bfloat16 activations, the weight repacked at load into its panels of 16 rows (same
  size): the 4-bit codes are multiplied as they are and each group's sum scaled once
  (about half the time of torch's INT4 GEMM at every row count). Elsewhere
  `torch.ops.aten._weight_int4pack_mm_for_cpu` on bfloat16 activations (float32 ones
  run a scalar path 20-40x slower there), K zero-padded to whole groups and N to a
  multiple of 16 (the op's packing needs it). Either way activations are cast to
  bfloat16 around it and the output back. On CUDA: the Triton W4A16 kernel
  (`kernels/w4a16_gemm.py`).

Layout changes at load time work in any format: the RoPE reordering of q/k rows
(`rope.interleave_rope_rows`) is a row permutation, and fusing q/k/v or gate/up is a
row concatenation. INT4 scales are per row, so they move with their rows exactly.
FP8's 128-row scale blocks would be split by either change, so at load the FP8
scales are expanded to one per (row, 128-column block) (3% more bytes than the
weight) before rows move. Nothing is requantised. A tensor-parallel rank's rows or
columns of a stored weight (its scales and groups with it) are read by
`backend/distributed/weight_slices.py`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from backend.errors import WeightsError

if TYPE_CHECKING:
    from backend.linear import LinearOp

__all__ = ["TensorSpec", "StoredWeight", "WeightFormat", "DenseFormat", "Fp8Format", "Int4Format",
           "FORMAT_NAMES", "INT4_GROUP_SIZES", "weight_format", "stored_format", "is_quantized_linear"]

FP8_BLOCK = 128
FP8_MAX = 448.0  # largest finite e4m3fn value
FP8_SCALE_FORMATS = (None, "ue8m0")  # weight_scale_inv: any float32, or powers of two
INT4_GROUP_SIZES = (32, 64, 128, 256)
FORMAT_NAMES = ("fp32", "bf16", "fp8", "int4")
INT4_METHOD = "edgeserve_int4"
CT_METHOD = "compressed-tensors"


class TensorSpec(NamedTuple):
    """What a stored tensor will be, known before it is computed (for streamed headers, sizes)."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


class StoredWeight(NamedTuple):
    """One linear weight in one format: its tensors by checkpoint suffix, and its logical shape."""

    tensors: dict[str, torch.Tensor]  # suffix ("weight", "qweight", ...) -> tensor
    shape: tuple[int, int]  # (out_features N, in_features K)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def is_quantized_linear(name: str) -> bool:
    """True for the checkpoint names a quantised format converts (`<m>.weight` of a projection)."""
    return name.startswith("model.layers.") and name.endswith("_proj.weight")


class WeightFormat(ABC):
    """How one linear weight is stored and run. Every method is pure: it returns new tensors
    (or a new GEMM object) and leaves its arguments untouched."""

    name: str
    suffixes: tuple[str, ...] = ("weight",)  # checkpoint tensors `<module>.<suffix>` of one weight

    @abstractmethod
    def specs(self, shape: tuple[int, int]) -> dict[str, TensorSpec]:
        """The tensors (suffix -> dtype and shape) a weight of `shape` is stored as."""

    @abstractmethod
    def quantize(self, w: torch.Tensor) -> StoredWeight:
        """Convert a float weight [N, K] into this format."""

    @abstractmethod
    def dequantize(self, sw: StoredWeight) -> torch.Tensor:
        """The weight [N, K] in float32, as the GEMM sees it."""

    @abstractmethod
    def cat_rows(self, parts: Sequence[StoredWeight]) -> StoredWeight:
        """Stack weights of equal K along N (fusing q/k/v or gate/up)."""

    @abstractmethod
    def permute_rows(self, sw: StoredWeight, perm: torch.Tensor) -> StoredWeight:
        """Row n of the result is row perm[n] of `sw` (the RoPE reordering of q/k)."""

    @abstractmethod
    def linear(self, sw: StoredWeight, bias: torch.Tensor | None, compute_dtype: torch.dtype,
               buckets: tuple[int, ...] = ()) -> LinearOp:
        """The runtime GEMM object for this weight (see `backend.linear`), on sw's device;
        `buckets` are the MKL-packed row counts of float32 weights."""

    def quantization_config(self) -> dict[str, Any] | None:
        """What config.json records for a checkpoint in this format (None: dense)."""
        return None

    def read(self, get: Callable[[str], torch.Tensor], module: str) -> StoredWeight:
        """Load `<module>.<suffix>` tensors through `get` (a checkpoint reader's)."""
        tensors = {suffix: get(f"{module}.{suffix}") for suffix in self.suffixes}
        return StoredWeight(tensors, self.logical_shape(tensors, module))

    def stores_dense(self, module: str, contains: Callable[[str], bool]) -> bool:
        """True when a checkpoint in this format holds `module` as a plain `<module>.weight` (a
        layer the quantiser left dense): it has the weight but not this format's extra tensors.
        `contains` says whether the checkpoint has a tensor name."""
        return not contains(f"{module}.{self.suffixes[-1]}") and contains(f"{module}.weight")

    def logical_shape(self, tensors: dict[str, torch.Tensor], module: str) -> tuple[int, int]:
        """(N, K) of a stored weight, checking its tensors fit together."""
        w = tensors["weight"]
        if w.dim() != 2:
            raise WeightsError(f"{module}.weight must be 2-D, got shape {tuple(w.shape)}", tensor=f"{module}.weight")
        return int(w.shape[0]), int(w.shape[1])

    def __repr__(self) -> str:
        return self.name


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------- dense

class DenseFormat(WeightFormat):
    """Plain weights in one float dtype (fp32 or bf16)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))

    def specs(self, shape: tuple[int, int]) -> dict[str, TensorSpec]:
        return {"weight": TensorSpec(self.dtype, tuple(shape))}

    def quantize(self, w: torch.Tensor) -> StoredWeight:
        return StoredWeight({"weight": w.to(self.dtype).contiguous()}, (int(w.shape[0]), int(w.shape[1])))

    def dequantize(self, sw: StoredWeight) -> torch.Tensor:
        return sw.tensors["weight"].float()

    def read(self, get: Callable[[str], torch.Tensor], module: str) -> StoredWeight:
        sw = super().read(get, module)
        w = sw.tensors["weight"]
        if not w.dtype.is_floating_point or w.dtype.itemsize < 2:
            raise WeightsError(f"{module}.weight is {w.dtype}, but config.json declares no quantization_config "
                               f"(a dense checkpoint); known formats: {', '.join(FORMAT_NAMES)}",
                               tensor=f"{module}.weight")
        return sw

    def cat_rows(self, parts: Sequence[StoredWeight]) -> StoredWeight:
        w = torch.cat([p.tensors["weight"] for p in parts])
        return StoredWeight({"weight": w}, (int(w.shape[0]), int(w.shape[1])))

    def permute_rows(self, sw: StoredWeight, perm: torch.Tensor) -> StoredWeight:
        return StoredWeight({"weight": sw.tensors["weight"][perm].contiguous()}, sw.shape)

    def linear(self, sw: StoredWeight, bias: torch.Tensor | None, compute_dtype: torch.dtype,
               buckets: tuple[int, ...] = ()) -> LinearOp:
        from backend.linear import Linear

        return Linear(sw.tensors["weight"].to(self.dtype).contiguous(), bias, buckets)


# ---------------------------------------------------------------- fp8

class Fp8Format(WeightFormat):
    """e4m3 weights with float32 block scales `weight_scale_inv` (see the module docstring)."""

    name = "fp8"
    suffixes = ("weight", "weight_scale_inv")

    def __init__(self, block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK), scale_fmt: str | None = None) -> None:
        if scale_fmt not in FP8_SCALE_FORMATS:
            raise WeightsError(f"unsupported fp8 scale_fmt {scale_fmt!r}; supported: float32 scales (none) or "
                               f"'ue8m0' (powers of two)", scale_fmt=scale_fmt)
        self.block = block
        self.scale_fmt = scale_fmt

    def specs(self, shape: tuple[int, int]) -> dict[str, TensorSpec]:
        n, k = shape
        bn, bk = self.block
        return {"weight": TensorSpec(torch.float8_e4m3fn, (n, k)),
                "weight_scale_inv": TensorSpec(torch.float32, (_ceil_div(n, bn), _ceil_div(k, bk)))}

    def quantize(self, w: torch.Tensor) -> StoredWeight:
        from kernels.fp8_gemm import quantize_fp8_blocks_ref

        q, scale = quantize_fp8_blocks_ref(w, self.block)
        if self.scale_fmt == "ue8m0":  # the next power of two up, then the codes again against it
            scale = torch.exp2(torch.ceil(torch.log2(scale)))
            s = scale.repeat_interleave(self.block[0], 0)[: w.shape[0]].repeat_interleave(self.block[1], 1)
            q = (w.float() / s[:, : w.shape[1]]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return StoredWeight({"weight": q, "weight_scale_inv": scale}, (int(w.shape[0]), int(w.shape[1])))

    def dequantize(self, sw: StoredWeight) -> torch.Tensor:
        from kernels.fp8_gemm import dequantize_fp8_blocks_ref

        return dequantize_fp8_blocks_ref(sw.tensors["weight"], sw.tensors["weight_scale_inv"], self._row_block(sw))

    def read(self, get: Callable[[str], torch.Tensor], module: str) -> StoredWeight:
        sw = super().read(get, module)
        w, scale = sw.tensors["weight"], sw.tensors["weight_scale_inv"]
        if w.dtype != torch.float8_e4m3fn:
            raise WeightsError(f"{module}.weight is {w.dtype}, expected float8_e4m3fn (an fp8 checkpoint)",
                               tensor=f"{module}.weight")
        want = self.specs(sw.shape)["weight_scale_inv"].shape
        if not scale.dtype.is_floating_point:
            raise WeightsError(f"{module}.weight_scale_inv is {scale.dtype}, expected float32 (or float8_e8m0fnu)",
                               tensor=f"{module}.weight_scale_inv")
        if tuple(scale.shape) != want:
            raise WeightsError(f"{module}.weight_scale_inv has shape {tuple(scale.shape)}, but a {list(sw.shape)} "
                               f"weight in {self.block[0]}x{self.block[1]} blocks needs {list(want)}",
                               tensor=f"{module}.weight_scale_inv")
        return StoredWeight({"weight": w, "weight_scale_inv": scale.float()}, sw.shape)

    def _row_block(self, sw: StoredWeight) -> tuple[int, int]:
        """(rows, columns) per scale: the checkpoint's block, or (1, columns) once expanded per row."""
        rows = 1 if sw.tensors["weight_scale_inv"].shape[0] == sw.shape[0] else self.block[0]
        return rows, self.block[1]

    def rowwise(self, sw: StoredWeight) -> StoredWeight:
        """The same weight with one scale per (row, column block): rows can then move freely."""
        rows, _ = self._row_block(sw)
        if rows == 1:
            return sw
        scale = sw.tensors["weight_scale_inv"].repeat_interleave(rows, dim=0)[: sw.shape[0]].contiguous()
        return StoredWeight({"weight": sw.tensors["weight"], "weight_scale_inv": scale}, sw.shape)

    def cat_rows(self, parts: Sequence[StoredWeight]) -> StoredWeight:
        parts = [self.rowwise(p) for p in parts]
        w = torch.cat([p.tensors["weight"].view(torch.uint8) for p in parts]).view(torch.float8_e4m3fn)
        scale = torch.cat([p.tensors["weight_scale_inv"] for p in parts])
        return StoredWeight({"weight": w, "weight_scale_inv": scale}, (int(w.shape[0]), parts[0].shape[1]))

    def permute_rows(self, sw: StoredWeight, perm: torch.Tensor) -> StoredWeight:
        sw = self.rowwise(sw)
        w = sw.tensors["weight"].view(torch.uint8)[perm].contiguous().view(torch.float8_e4m3fn)
        return StoredWeight({"weight": w, "weight_scale_inv": sw.tensors["weight_scale_inv"][perm].contiguous()},
                            sw.shape)

    def linear(self, sw: StoredWeight, bias: torch.Tensor | None, compute_dtype: torch.dtype,
               buckets: tuple[int, ...] = ()) -> LinearOp:
        from backend.linear import Fp8Linear, Linear

        if sw.tensors["weight"].device.type == "cuda":
            rows = self.rowwise(sw)
            return Fp8Linear(rows.tensors["weight"], rows.tensors["weight_scale_inv"], self.block[1], bias)
        # CPU: no FP8 GEMM; dequantised once here into the compute dtype (see the module docstring)
        return Linear(self.dequantize(sw).to(compute_dtype).contiguous(), bias, buckets)

    def quantization_config(self) -> dict[str, Any]:
        qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": list(self.block)}
        return {**qc, "scale_fmt": self.scale_fmt} if self.scale_fmt else qc


# ---------------------------------------------------------------- int4

class Int4Format(WeightFormat):
    """Asymmetric group-wise INT4, two codes per byte (see the module docstring)."""

    name = "int4"
    suffixes = ("qweight", "scales", "zeros")

    def __init__(self, group_size: int = 128) -> None:
        if group_size not in INT4_GROUP_SIZES:
            raise WeightsError(f"INT4 group size {group_size} is not supported; choose one of "
                               f"{', '.join(map(str, INT4_GROUP_SIZES))}", group_size=group_size)
        self.group_size = group_size

    def __repr__(self) -> str:
        return f"int4(g{self.group_size})"

    def specs(self, shape: tuple[int, int]) -> dict[str, TensorSpec]:
        n, k = shape
        groups = _ceil_div(k, self.group_size)
        return {"qweight": TensorSpec(torch.uint8, (n, k // 2)),
                "scales": TensorSpec(torch.bfloat16, (n, groups)),
                "zeros": TensorSpec(torch.bfloat16, (n, groups))}

    def quantize(self, w: torch.Tensor) -> StoredWeight:
        from kernels.w4a16_gemm import quantize_int4_ref

        if w.shape[1] % 2:
            raise WeightsError(f"INT4 packs two codes per byte along in_features, so it must be even; got a "
                               f"{list(w.shape)} weight", shape=list(w.shape))
        qweight, scales, zeros = quantize_int4_ref(w, self.group_size)
        return StoredWeight({"qweight": qweight, "scales": scales, "zeros": zeros}, (int(w.shape[0]), int(w.shape[1])))

    def dequantize(self, sw: StoredWeight) -> torch.Tensor:
        from kernels.w4a16_gemm import dequantize_int4_ref

        t = sw.tensors
        return dequantize_int4_ref(t["qweight"], t["scales"], t["zeros"], self.group_size, sw.shape[1])

    def logical_shape(self, tensors: dict[str, torch.Tensor], module: str) -> tuple[int, int]:
        q, s, z = tensors["qweight"], tensors["scales"], tensors["zeros"]
        if q.dtype != torch.uint8 or q.dim() != 2:
            raise WeightsError(f"{module}.qweight must be 2-D uint8, got {q.dtype} {tuple(q.shape)}",
                               tensor=f"{module}.qweight")
        shape = (int(q.shape[0]), 2 * int(q.shape[1]))
        if {n: TensorSpec(t.dtype, tuple(t.shape)) for n, t in tensors.items()} != self.specs(shape):
            raise WeightsError(f"{module}: qweight {tuple(q.shape)}, scales {tuple(s.shape)} {s.dtype}, zeros "
                               f"{tuple(z.shape)} {z.dtype} do not fit INT4 group size {self.group_size}",
                               tensor=module)
        return shape

    def cat_rows(self, parts: Sequence[StoredWeight]) -> StoredWeight:
        t = {s: torch.cat([p.tensors[s] for p in parts]) for s in self.suffixes}
        return StoredWeight(t, (int(t["qweight"].shape[0]), parts[0].shape[1]))

    def permute_rows(self, sw: StoredWeight, perm: torch.Tensor) -> StoredWeight:
        return StoredWeight({s: t[perm].contiguous() for s, t in sw.tensors.items()}, sw.shape)

    def linear(self, sw: StoredWeight, bias: torch.Tensor | None, compute_dtype: torch.dtype,
               buckets: tuple[int, ...] = ()) -> LinearOp:
        from backend.linear import Int4Linear

        t = sw.tensors
        return Int4Linear(t["qweight"], t["scales"], t["zeros"], self.group_size, sw.shape[1], bias)

    def quantization_config(self) -> dict[str, Any]:
        return {"quant_method": INT4_METHOD, "bits": 4, "group_size": self.group_size,
                "zero_point": "midpoint_value", "packing": "uint8_low_nibble_first"}


# ---------------------------------------------------------------- choosing

def weight_format(name: str, group_size: int = 128) -> WeightFormat:
    """The format called `name` (fp32, bf16, fp8, int4); `group_size` applies to int4."""
    if name == "fp32":
        return DenseFormat(torch.float32)
    if name == "bf16":
        return DenseFormat(torch.bfloat16)
    if name == "fp8":
        return Fp8Format()
    if name == "int4":
        return Int4Format(group_size)
    raise WeightsError(f"unknown weight format {name!r}; known: {', '.join(FORMAT_NAMES)}", format=name)


def stored_format(qc: dict[str, Any] | None, prefix: str = "") -> WeightFormat | None:
    """The format a checkpoint's linear weights are stored in, from config.json's
    `quantization_config`; None for a dense checkpoint (each tensor in its own float dtype).
    `prefix` is where the checkpoint keeps the text model (`ModelConfig.checkpoint_prefix`):
    compressed-tensors' module lists may name modules with or without it."""
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        fmt = qc.get("fmt", "e4m3")
        block = qc.get("weight_block_size")
        if fmt != "e4m3" or not (isinstance(block, list) and len(block) == 2):
            raise WeightsError(f"unsupported fp8 checkpoint (fmt {fmt!r}, weight_block_size {block!r}); "
                               f"supported: e4m3 with [rows, columns] block scales", quantization_config=qc)
        return Fp8Format((int(block[0]), int(block[1])), qc.get("scale_fmt"))
    if method == INT4_METHOD:
        return Int4Format(int(qc.get("group_size", 128)))
    if method == CT_METHOD:
        from backend.compressed_tensors import compressed_tensors_format

        return compressed_tensors_format(qc, prefix)
    raise WeightsError(f"unknown weight format in config.json: quant_method {method!r}; known: fp8 (e4m3, block "
                       f"scales), {INT4_METHOD}, {CT_METHOD} (pack-quantized INT4), or none (dense)",
                       quantization_config=qc)
