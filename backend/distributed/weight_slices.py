"""A tensor-parallel rank's rows or columns of one stored linear weight, in each weight format.

The shard plan (`sharding.py`) names a slice of a linear's logical weight W [N, K]: rows
[a, b) (column-parallel) or columns [a, b) (row-parallel). `read_slice` reads the stored
tensors that hold exactly that part, through a reader's `get_region`, so a rank never
reads the rest (its `bytes_read` counts what it did read); `stored_shape` gives (N, K)
from the file headers alone. Layouts and numerics of the formats are in
`backend/weight_formats.py` and `backend/compressed_tensors.py`.

- dense: the rows or columns of ``weight``.
- fp8 (``weight`` e4m3 [N, K], ``weight_scale_inv`` float32 [ceil(N/bn), ceil(K/bk)],
  128 x 128 blocks in the public checkpoints): the rows (columns) of ``weight`` and the
  scale rows (columns) of every block the range touches, blocks [a // B, ceil(b / B)), so
  a block cut by a shard boundary has its scale read by the ranks on both sides.
  A range starting on a block boundary keeps the block form (a last partial block is what
  a weight of b - a rows or columns has anyway). Rows starting inside a block get one
  scale per (row, column block), the form the format already uses once rows are fused or
  permuted (`Fp8Format.rowwise`). Columns starting inside a block cannot keep FP8 scales
  of any block size the GEMMs take (every later column block would straddle two stored
  scales), so that slice is dequantised exactly at load, float(q) * its block's scale (the
  values the FP8 GEMM multiplies, and what the CPU runtime holds for every FP8 weight
  anyway), and returned as float32 dense: held in the compute dtype, on a GPU at twice
  the FP8 bytes for that weight only. The public FP8 checkpoints do not reach that case at
  the usual sizes: each rank's columns of o_proj (heads x v_head_dim: DeepSeek-V3
  128 x 128, GLM-5 64 x 256) and of down_proj (intermediate 18432 / 12288, experts 2048)
  are a multiple of 128 at TP 2..16. A tiny test model reaches it and computes the same.
- int4 (ours: ``qweight`` uint8 [N, K/2], ``scales`` / ``zeros`` [N, ceil(K/g)]): rows
  anywhere; columns on group boundaries only (a and b multiples of g, or b = K where K
  ends in a partial group): bytes [a/2, b/2) and groups [a/g, ceil(b/g)).
- compressed-tensors pack-quantized (``weight_packed`` int32 [N, K/8], ``weight_scale``
  [N, K/g], ``weight_shape`` [2]): rows anywhere; columns on group boundaries (g is a
  multiple of 8, so whole words): words [a/8, b/8) and groups [a/g, b/g). ``weight_shape``
  (16 bytes) is read whole and checked against the headers. An asymmetric one
  (``symmetric: false``) also has ``weight_zero_point`` int32 [ceil(N/8), K/g], eight 4-bit
  zero points per word packed along the *rows*: a row range reads the words [a // 8,
  ceil(b / 8)) that hold its rows (a range starting or ending inside a word shares that word
  with the neighbouring rank) and repacks its own rows; a column range reads groups
  [a/g, b/g) of every word.

An INT4 column range that cuts a group is refused (`WeightsError`): the group's one scale
(and zero point) would be needed on both sides of a split through packed codes, and the
INT4 GEMMs run whole groups. Kimi's routed experts (2048 rows in groups of 32) split evenly
up to TP 64, and `--expert-parallel` keeps experts whole.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from backend.compressed_tensors import (CompressedTensorsInt4, CompressedTensorsZeroPointInt4, int4_from_pack_quantized,
                                        pack_zero_points, unpack_zero_points)
from backend.errors import WeightsError
from backend.weight_formats import DenseFormat, Fp8Format, Int4Format, StoredWeight, TensorSpec, WeightFormat

__all__ = ["Region", "Spec", "stored_shape", "read_slice", "check_group_split"]

Region = Callable[[str, list[tuple[int, int]]], torch.Tensor]  # `CheckpointReader.get_region`
Spec = Callable[[str], TensorSpec]  # `CheckpointReader.spec`
_PACKED = (CompressedTensorsInt4, CompressedTensorsZeroPointInt4)  # pack-quantized, symmetric or zero-point


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _ranges(dim: int, start: int, stop: int, rows: int) -> list[tuple[int, int]]:
    """The `get_region` ranges of rows (dim 0) or columns (dim 1) [start, stop) of a [rows, ...] tensor."""
    return [(start, stop)] if dim == 0 else [(0, rows), (start, stop)]


def _shape(spec: Spec, name: str) -> tuple[int, int]:
    shape = spec(name).shape
    if len(shape) != 2:
        raise WeightsError(f"{name} must be 2-D, got shape {list(shape)}", tensor=name)
    return int(shape[0]), int(shape[1])


def stored_shape(fmt: WeightFormat, spec: Spec, module: str) -> tuple[int, int]:
    """(N, K) of linear `module` stored in `fmt`, from the checkpoint headers alone."""
    if isinstance(fmt, _PACKED):  # K = groups x g (a packed K is a multiple of g)
        n, groups = _shape(spec, f"{module}.weight_scale")
        return n, groups * fmt.group_size
    if isinstance(fmt, Int4Format):
        n, half = _shape(spec, f"{module}.qweight")
        return n, 2 * half
    return _shape(spec, f"{module}.weight")


def check_group_split(module: str, in_features: int, start: int, stop: int, group_size: int) -> None:
    """Refuse columns [start, stop) of an INT4 weight that cut one of its groups of `group_size`."""
    if start % group_size or (stop % group_size and stop != in_features):
        raise WeightsError(f"{module}: a tensor-parallel rank's columns [{start}, {stop}) of in_features "
                           f"{in_features} cut INT4 groups of {group_size} (each rank must hold whole groups); "
                           f"choose a tensor-parallel size whose share of in_features is a multiple of "
                           f"{group_size}, or --expert-parallel for routed experts", tensor=module,
                           group_size=group_size)


def read_slice(fmt: WeightFormat, region: Region, spec: Spec, module: str, dim: int, start: int,
               stop: int) -> tuple[WeightFormat, StoredWeight]:
    """Rows (dim 0) or columns (dim 1) [start, stop) of linear `module` stored in `fmt`, reading only
    the stored bytes they need (module docstring). Returns the format the slice is held in (`fmt`,
    or float32 `DenseFormat` for FP8 columns that start inside a scale block) and the slice; an
    INT4 slice comes in `Int4Format`'s layout, as `fmt.read` gives it."""
    n, k = stored_shape(fmt, spec, module)
    if dim not in (0, 1) or not 0 <= start < stop <= (n, k)[dim]:
        raise WeightsError(f"slice [{start}, {stop}) of dim {dim} is outside {module} of shape {[n, k]}",
                           tensor=module)
    if isinstance(fmt, _PACKED):
        return fmt, _pack_quantized(fmt, region, module, (n, k), dim, start, stop)
    if isinstance(fmt, Int4Format):
        return fmt, _int4(fmt, region, module, (n, k), dim, start, stop)
    if isinstance(fmt, Fp8Format):
        return _fp8(fmt, region, spec, module, (n, k), dim, start, stop)
    if isinstance(fmt, DenseFormat):
        ranges = _ranges(dim, start, stop, n)
        return fmt, fmt.read(lambda name: region(name, ranges), module)
    raise WeightsError(f"{module}: tensor-parallel slices of {fmt!r} weights are not supported", tensor=module)


def _fp8(fmt: Fp8Format, region: Region, spec: Spec, module: str, shape: tuple[int, int], dim: int, start: int,
         stop: int) -> tuple[WeightFormat, StoredWeight]:
    n, k = shape
    w_spec, s_spec = spec(f"{module}.weight"), spec(f"{module}.weight_scale_inv")
    want = fmt.specs(shape)["weight_scale_inv"].shape
    if w_spec.dtype != torch.float8_e4m3fn or not s_spec.dtype.is_floating_point or s_spec.shape != want:
        raise WeightsError(f"{module}: weight {w_spec.dtype} {list(w_spec.shape)} with weight_scale_inv "
                           f"{s_spec.dtype} {list(s_spec.shape)}; an fp8 checkpoint in {fmt.block[0]}x{fmt.block[1]} "
                           f"blocks stores float8_e4m3fn {[n, k]} with float scales {list(want)}", tensor=module)
    size = fmt.block[dim]
    first, end = start // size, _ceil(stop, size)  # the blocks [first, end) the range touches
    w = region(f"{module}.weight", _ranges(dim, start, stop, n))
    scale = region(f"{module}.weight_scale_inv", _ranges(dim, first, end, want[0])).float()
    part = (stop - start, k) if dim == 0 else (n, stop - start)
    if start % size == 0:  # the slice's blocks are the stored ones (the last may be partial)
        return fmt, StoredWeight({"weight": w, "weight_scale_inv": scale}, part)
    blocks = torch.arange(start, stop) // size - first  # each row's (column's) block among those read
    if dim == 0:  # one scale per (row, column block): the row-wise form `Fp8Format` recognises
        return fmt, StoredWeight({"weight": w, "weight_scale_inv": scale[blocks].contiguous()}, part)
    per_row = scale.repeat_interleave(fmt.block[0], dim=0)[:n]  # [N, blocks read]
    dense = w.float() * per_row[:, blocks]  # [N, stop - start]: float(q) times its block's scale
    return DenseFormat(torch.float32), StoredWeight({"weight": dense}, part)


def _int4(fmt: Int4Format, region: Region, module: str, shape: tuple[int, int], dim: int, start: int,
          stop: int) -> StoredWeight:
    n, k = shape
    if dim == 0:
        return fmt.read(lambda name: region(name, [(start, stop)]), module)
    g = fmt.group_size
    check_group_split(module, k, start, stop, g)
    cols = {"qweight": (start // 2, stop // 2), "scales": (start // g, _ceil(stop, g)),
            "zeros": (start // g, _ceil(stop, g))}
    return fmt.read(lambda name: region(name, [(0, n), cols[name.rsplit(".", 1)[1]]]), module)


def _pack_quantized(fmt: CompressedTensorsInt4 | CompressedTensorsZeroPointInt4, region: Region, module: str,
                    shape: tuple[int, int], dim: int, start: int, stop: int) -> StoredWeight:
    n, k = shape
    whole = region(f"{module}.weight_shape", [(0, 2)])
    if whole.dim() != 1 or whole.dtype.is_floating_point or whole.tolist() != [n, k]:
        raise WeightsError(f"{module}.weight_shape is {whole.tolist()}, but weight_scale's header says [{n}, {k}] "
                           f"in groups of {fmt.group_size}", tensor=f"{module}.weight_shape")
    g = fmt.group_size
    zero = None
    if dim == 0:
        packed = region(f"{module}.weight_packed", [(start, stop)])
        scale = region(f"{module}.weight_scale", [(start, stop)])
        part = [stop - start, k]
        if isinstance(fmt, CompressedTensorsZeroPointInt4):  # the words holding rows [start, stop), repacked
            first, end = start // 8, _ceil(stop, 8)
            words = region(f"{module}.weight_zero_point", [(first, end), (0, k // g)])
            rows = unpack_zero_points(words, 8 * (end - first), module)[start - 8 * first:stop - 8 * first]
            zero = pack_zero_points(rows)
    else:
        check_group_split(module, k, start, stop, g)
        packed = region(f"{module}.weight_packed", [(0, n), (start // 8, stop // 8)])
        scale = region(f"{module}.weight_scale", [(0, n), (start // g, stop // g)])
        part = [n, stop - start]
        if isinstance(fmt, CompressedTensorsZeroPointInt4):
            zero = region(f"{module}.weight_zero_point", [(0, _ceil(n, 8)), (start // g, stop // g)])
    return int4_from_pack_quantized(packed, scale, torch.tensor(part), g, module, zero)
