"""`index_copy_` of whole rows at memory speed, whatever the tensors' element type.

PyTorch's CPU `index_copy_` moves one element at a time, so how fast a row copies depends on
its element size, not its bytes: 64 rows of 3,072 uint8 (one 1,024-token layer of SmolLM2's
FP8 K pages) took 0.16 ms on one Zen 4 core, the same bytes as int64 0.03 ms, a plain slice
copy 0.006 ms. KV pages are byte rows (FP8 values, int8 exponents, latent and indexer rows),
so installing a transferred prompt or a block fetched from the KV store ran at ~1 GB/s.

`index_copy_rows(dst, dim, index, src)` does what `dst.index_copy_(dim, index, src)` does, with
the dims after `dim` merged into one row (they must be contiguous in `dst`) and the row read as
the widest of int64 / int32 / int16 that divides its bytes, its strides and both tensors'
offsets. Other devices, and rows no wider type divides, copy as `index_copy_` does.
"""

from __future__ import annotations

import torch

__all__ = ["index_copy_rows"]

_WIDE = ((8, torch.int64), (4, torch.int32), (2, torch.int16))


def index_copy_rows(dst: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.index_copy_(dim, index, src)`, copying the slices after `dim` as wide integers (module docstring).
    Raises RuntimeError when the dims after `dim` are not contiguous in `dst` (they must merge into a view)."""
    dim %= dst.dim()
    if dst.device.type != "cpu" or dim == dst.dim() - 1 or dst.dtype != src.dtype:
        if dst.dtype == src.dtype and dst.element_size() == 1:  # float8 has no index_copy_: as bytes
            dst, src = dst.view(torch.uint8), src.view(torch.uint8)
        dst.index_copy_(dim, index, src)
        return
    rows = dst.view(*dst.shape[:dim + 1], -1).view(torch.uint8)
    data = src.reshape(*src.shape[:dim + 1], -1).contiguous().view(torch.uint8)
    for width, wide in _WIDE:
        if all(_divides(t, width) for t in (rows, data)):
            rows, data = rows.view(wide), data.view(wide)
            break
    rows.index_copy_(dim, index, data)


def _divides(t: torch.Tensor, width: int) -> bool:
    """Whether `t` (bytes, last dim contiguous) can be viewed as `width`-byte integers."""
    return (t.shape[-1] % width == 0 and t.storage_offset() % width == 0
            and all(s % width == 0 for s in t.stride()[:-1]))
