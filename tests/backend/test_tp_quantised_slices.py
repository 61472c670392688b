"""A tensor-parallel rank's rows or columns of a quantised linear, read from the file without the rest:
FP8 block-scaled (ranges starting on and inside a scale block, partial edge blocks), our INT4 format
(rows anywhere, columns on group boundaries, a partial last group) and compressed-tensors
pack-quantized (Kimi K2.x), symmetric and with zero points. Each slice dequantises to exactly the matching part of the whole weight,
and the reader counts exactly the bytes of the stored rows, columns, blocks and groups the range
touches. Column ranges that cut an INT4 group are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from backend.compressed_tensors import (CompressedTensorsInt4, CompressedTensorsZeroPointInt4, asymmetric_int4,
                                        pack_quantized_tensors, symmetric_int4)
from backend.distributed.weight_slices import read_slice
from backend.errors import WeightsError
from backend.weight_formats import DenseFormat, Fp8Format, Int4Format, StoredWeight, WeightFormat
from backend.weights import CheckpointReader


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def reader_of(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> CheckpointReader:
    tmp_path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp_path / "model.safetensors")
    return CheckpointReader(tmp_path)


def fp8_reader(tmp_path: Path, sw: StoredWeight) -> CheckpointReader:
    return reader_of(tmp_path, {f"m.{s}": t for s, t in sw.tensors.items()})


def read(fmt: WeightFormat, reader: CheckpointReader, dim: int, start: int, stop: int
         ) -> tuple[WeightFormat, StoredWeight, int]:
    """(held format, slice, bytes the reader returned for it)."""
    before = reader.bytes_read
    src, sw = read_slice(fmt, reader.get_region, reader.spec, "m", dim, start, stop)
    return src, sw, reader.bytes_read - before


def part(t: torch.Tensor, dim: int, start: int, stop: int) -> torch.Tensor:
    return t[start:stop] if dim == 0 else t[:, start:stop]


# rows and columns: from 0, on a 16-block boundary, inside a block (both ends), one row or column,
# up to the partial last block (40 = 2 x 16 + 8 rows, 56 = 3 x 16 + 8 columns)
FP8_RANGES = [(0, 0, 16), (0, 16, 40), (0, 8, 20), (0, 20, 40), (0, 13, 14), (0, 0, 40),
              (1, 0, 32), (1, 32, 56), (1, 24, 40), (1, 8, 9), (1, 48, 56)]


@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_fp8_slices_dequantise_to_the_whole_weights_part(tmp_path: Path, scale_fmt: str | None) -> None:
    fmt = Fp8Format((16, 16), scale_fmt)
    sw = fmt.quantize(torch.randn(40, 56) * 3.0)  # scales other than 1
    whole = fmt.dequantize(sw)
    reader = fp8_reader(tmp_path, sw)
    for dim, a, b in FP8_RANGES:
        src, got, nbytes = read(fmt, reader, dim, a, b)
        assert got.shape == tuple(part(whole, dim, a, b).shape)
        assert torch.equal(src.dequantize(got), part(whole, dim, a, b)), (dim, a, b)
        inside = a % 16 != 0
        # FP8 is kept, except for columns that start inside a scale block (dequantised exactly)
        assert isinstance(src, DenseFormat) == (dim == 1 and inside)
        if dim == 0 and inside:
            assert got.tensors["weight_scale_inv"].shape == (b - a, 4)  # one scale per (row, column block)
        blocks = _ceil(b, 16) - a // 16  # every block the range touches: cut blocks read by both sides
        want = (b - a) * 56 + blocks * 4 * 4 if dim == 0 else 40 * (b - a) + 3 * blocks * 4
        assert nbytes == want, (dim, a, b)


def test_fp8_row_slices_cut_inside_a_block_fuse_and_run_like_the_whole(tmp_path: Path) -> None:
    """Two ranks' rows [0, 20) and [20, 40) (a cut inside the second 16-row block): each runs the GEMM
    of its rows of the whole weight, and fusing them (rows concatenated) gives the whole weight back."""
    fmt = Fp8Format((16, 16))
    sw = fmt.quantize(torch.randn(40, 56))
    reader = fp8_reader(tmp_path, sw)
    x = torch.randn(5, 56)
    whole = fmt.linear(sw, None, torch.float32)(x)
    halves = [read(fmt, reader, 0, a, b)[1] for a, b in ((0, 20), (20, 40))]
    outs = [fmt.linear(h, None, torch.float32)(x) for h in halves]
    torch.testing.assert_close(torch.cat(outs, dim=1), whole, rtol=0, atol=0)
    assert torch.equal(fmt.dequantize(fmt.cat_rows(halves)), fmt.dequantize(sw))


def test_fp8_column_shards_sum_to_the_whole_product(tmp_path: Path) -> None:
    """A row-parallel split at column 24 (inside a block): the ranks' partial products sum to x @ W.T."""
    fmt = Fp8Format((16, 16))
    sw = fmt.quantize(torch.randn(40, 56) * 0.5)
    reader = fp8_reader(tmp_path, sw)
    x = torch.randn(3, 56, dtype=torch.float64)
    total = torch.zeros(3, 40, dtype=torch.float64)
    for a, b in ((0, 24), (24, 56)):
        src, got, _ = read(fmt, reader, 1, a, b)
        total += x[:, a:b] @ src.dequantize(got).double().t()
    torch.testing.assert_close(total, x @ fmt.dequantize(sw).double().t(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("k", [96, 80], ids=["whole-groups", "partial-last-group"])
def test_int4_slices_rows_anywhere_columns_on_group_boundaries(tmp_path: Path, k: int) -> None:
    fmt = Int4Format(32)
    sw = fmt.quantize(torch.randn(24, k))
    whole = fmt.dequantize(sw)
    groups = _ceil(k, 32)
    reader = reader_of(tmp_path, {f"m.{s}": t for s, t in sw.tensors.items()})
    for dim, a, b in [(0, 0, 12), (0, 5, 17), (0, 23, 24), (1, 0, 32), (1, 32, 64), (1, 64, k), (1, 0, k)]:
        src, got, nbytes = read(fmt, reader, dim, a, b)
        assert src is fmt and torch.equal(fmt.dequantize(got), part(whole, dim, a, b)), (dim, a, b)
        if dim == 0:
            want = (b - a) * (k // 2 + 2 * groups * 2)
        else:
            want = 24 * (b - a) // 2 + 2 * 24 * (_ceil(b, 32) - a // 32) * 2
        assert nbytes == want, (dim, a, b)
    for a, b in [(16, 64), (0, 48), (40, k)]:
        with pytest.raises(WeightsError, match="cut INT4 groups of 32"):
            read(fmt, reader, 1, a, b)


def test_pack_quantized_slices_keep_codes_and_scales(tmp_path: Path) -> None:
    n, k, g = 24, 128, 32
    int4 = symmetric_int4(torch.randn(n, k) * 2.0, g)
    whole = Int4Format(g).dequantize(int4)
    reader = reader_of(tmp_path, pack_quantized_tensors("m", int4))
    fmt = CompressedTensorsInt4(g, ["Linear"], [])
    for dim, a, b in [(0, 0, 12), (0, 7, 19), (1, 0, 64), (1, 64, 128), (1, 32, 96)]:
        src, got, nbytes = read(fmt, reader, dim, a, b)
        assert src is fmt and got.shape == tuple(part(whole, dim, a, b).shape)
        assert torch.equal(got.tensors["qweight"], part(int4.tensors["qweight"], dim, *((a, b) if dim == 0 else
                                                                                        (a // 2, b // 2))))
        assert torch.equal(fmt.dequantize(got), part(whole, dim, a, b)), (dim, a, b)
        if dim == 0:
            want = (b - a) * (k // 8 * 4 + k // g * 2) + 16
        else:
            want = n * (b - a) // 8 * 4 + n * (b - a) // g * 2 + 16  # weight_shape (int64 [2]) read whole
        assert nbytes == want, (dim, a, b)
    with pytest.raises(WeightsError, match="cut INT4 groups of 32"):
        read(fmt, reader, 1, 16, 128)


def test_zero_point_pack_quantized_slices_equal_the_unsliced_weight(tmp_path: Path) -> None:
    """An asymmetric pack-quantized weight (zero points packed eight to a word along the rows): row ranges
    starting and ending inside a word, on word boundaries, and column ranges of whole groups each give
    the codes, scales and zeros of the unsliced read, and two ranks' rows fuse back into it."""
    n, k, g = 44, 128, 32  # 44 rows: five full zero-point words and a half one
    int4 = asymmetric_int4(torch.randn(n, k) * 2.0 + 0.7, g)  # off-centre groups: zero points other than 0
    reader = reader_of(tmp_path, pack_quantized_tensors("m", int4, symmetric=False))
    fmt = CompressedTensorsZeroPointInt4(g, ["Linear"], [])
    whole = fmt.read(reader.get, "m")
    assert whole.tensors["zeros"].abs().sum() > 0
    for dim, a, b in [(0, 0, 22), (0, 22, 44), (0, 5, 13), (0, 8, 16), (0, 43, 44), (1, 0, 64), (1, 32, 96)]:
        src, got, nbytes = read(fmt, reader, dim, a, b)
        assert src is fmt and got.shape == tuple(part(fmt.dequantize(whole), dim, a, b).shape)
        for name, t in got.tensors.items():
            cols = (a // 2, b // 2) if name == "qweight" else (a // g, b // g)
            assert torch.equal(t, part(whole.tensors[name], dim, *((a, b) if dim == 0 else cols))), (dim, a, b, name)
        words = _ceil(b, 8) - a // 8 if dim == 0 else _ceil(n, 8)
        zp_bytes = words * (k // g) * 4 if dim == 0 else words * (b - a) // g * 4
        rest = (b - a) * (k // 8 * 4 + k // g * 2) if dim == 0 else n * (b - a) // 8 * 4 + n * (b - a) // g * 2
        assert nbytes == rest + zp_bytes + 16, (dim, a, b)
    halves = [read(fmt, reader, 0, a, b)[1] for a, b in ((0, 21), (21, 44))]
    assert torch.equal(fmt.dequantize(fmt.cat_rows(halves)), fmt.dequantize(whole))


def test_pack_quantized_slice_checks_weight_shape(tmp_path: Path) -> None:
    tensors = pack_quantized_tensors("m", symmetric_int4(torch.randn(8, 64), 32))
    tensors["m.weight_shape"] = torch.tensor([8, 96])
    reader = reader_of(tmp_path, tensors)
    with pytest.raises(WeightsError, match="weight_shape"):
        read(CompressedTensorsInt4(32, ["Linear"], []), reader, 0, 0, 4)


def test_slices_outside_the_weight_are_refused(tmp_path: Path) -> None:
    fmt = Fp8Format((16, 16))
    sw = fmt.quantize(torch.randn(20, 32))
    reader = fp8_reader(tmp_path, sw)
    for dim, a, b in [(0, 10, 21), (1, 5, 5), (2, 0, 1)]:
        with pytest.raises(WeightsError):
            read(fmt, reader, dim, a, b)


def test_fp8_slice_checks_the_headers_first(tmp_path: Path) -> None:
    """Scales of the wrong block count, or a weight that is not e4m3, are refused before any data is read."""
    fmt = Fp8Format((16, 16))
    sw = fmt.quantize(torch.randn(40, 56))
    bad_scale = reader_of(tmp_path / "a", {"m.weight": sw.tensors["weight"],
                                           "m.weight_scale_inv": sw.tensors["weight_scale_inv"][:2]})
    bad_weight = reader_of(tmp_path / "b", {"m.weight": fmt.dequantize(sw),
                                            "m.weight_scale_inv": sw.tensors["weight_scale_inv"]})
    for reader in (bad_scale, bad_weight):
        with pytest.raises(WeightsError, match="float8_e4m3fn"):
            read(fmt, reader, 0, 0, 20)
        assert reader.bytes_read == 0
