"""`index_copy_rows` against `index_copy_` on fresh random tensors: every dtype, dim and offset it may widen."""

from __future__ import annotations

import pytest
import torch

from backend.row_copies import index_copy_rows


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.bfloat16, torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("shape,dim", [((7, 16, 3, 64), 0), ((2, 2, 9, 16, 3), 2), ((5, 11), 0), ((4, 6, 5), 1),
                                       ((3, 8, 2), 2)])
def test_rows_copied_wide_equal_index_copy(dtype: torch.dtype, shape: tuple[int, ...], dim: int) -> None:
    gen = torch.Generator().manual_seed(hash((str(dtype), shape, dim)) % 2**31)
    raw = lambda *s: torch.randint(0, 256, (*s[:-1], s[-1] * torch.empty((), dtype=dtype).element_size()),  # noqa: E731
                                   dtype=torch.uint8, generator=gen).view(dtype)
    dst = raw(*shape)
    n = max(1, shape[dim] // 2)
    index = torch.randperm(shape[dim], generator=gen)[:n]
    src_shape = (*shape[:dim], n, *shape[dim + 1:])
    src = raw(1, *src_shape)[0] if dim else raw(*src_shape)
    for source in (src, raw(2, *src_shape)[1]):  # the second sits at an offset of one tensor's bytes
        want, got = dst.clone(), dst.clone()
        as_int = (lambda t: t.view(torch.uint8)) if dtype == torch.float8_e4m3fn else (lambda t: t)  # noqa: E731
        as_int(want).index_copy_(dim, index, as_int(source))  # (no index_copy_ of float8 on the CPU)
        index_copy_rows(got, dim, index, source)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_an_odd_offset_or_row_falls_back_to_narrower_integers() -> None:
    gen = torch.Generator().manual_seed(3)
    buf = torch.randint(0, 256, (1 + 6 * 12,), dtype=torch.uint8, generator=gen)
    src = buf[1:].view(6, 12)  # storage offset 1: only bytes divide it
    dst = torch.zeros(10, 12, dtype=torch.uint8)
    index = torch.tensor([9, 0, 4, 2, 7, 5])
    want = dst.clone().index_copy_(0, index, src)
    index_copy_rows(dst, 0, index, src)
    assert torch.equal(dst, want)


def test_rows_that_are_not_contiguous_in_the_destination_are_refused() -> None:
    dst = torch.zeros(4, 8, 6, dtype=torch.uint8).transpose(1, 2)  # the dims after 0 do not merge into a view
    with pytest.raises(RuntimeError):
        index_copy_rows(dst, 0, torch.tensor([1]), torch.ones(1, 6, 8, dtype=torch.uint8))
