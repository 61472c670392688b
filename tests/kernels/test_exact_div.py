"""`div_exact` (kernels/exact_div.py): the correctly rounded quotient on every device, where CUDA's division by a
Python scalar is a product with the reciprocal (an ulp off for some inputs)."""

from __future__ import annotations

import os

import pytest
import torch

from kernels.exact_div import div_exact
from tests.kernels.test_kv_store import seed  # noqa: F401  (fixture)


@pytest.mark.parametrize("divisor", [448.0, 15.0, 7.5])
def test_the_quotient_is_correctly_rounded(divisor: float, seed: int) -> None:
    t = torch.rand(100_000) * torch.exp2(torch.randint(-20, 20, (100_000,)).float())
    got = div_exact(t, divisor)
    want = (t.double() / divisor).float()  # the float64 quotient rounds once to float32: correctly rounded
    assert torch.equal(got, want)
    assert not torch.equal(t * (1.0 / divisor), want)  # what CUDA computes for t / divisor: off for some inputs


@pytest.mark.cuda
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available(),
                    reason="needs a CUDA device and TRITON_INTERPRET=0")
def test_a_gpu_gives_the_cpus_bits(seed: int) -> None:
    t = torch.rand(100_000) * 1000
    assert torch.equal(div_exact(t.cuda(), 448.0).cpu(), div_exact(t, 448.0))
