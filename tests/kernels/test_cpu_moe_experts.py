"""The routed-experts kernel (kernels/cpu/moe_experts.c) on fresh random weights and routings: float32 against a
float64 reference, bfloat16 and INT4 bit for bit against the loop of the GEMV and SwiGLU kernels it calls,
results independent of the thread count (the experts shared out between threads, or run in turn with split
calls), experts without rows left alone, and its refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from backend.moe_experts import sort_by_expert
from kernels import cpu_gemv, cpu_moe_experts
from kernels.cpu_gemv_int4 import gemv_int4, pack
from kernels.cpu_silu_mul import silu_mul_bf16
from kernels.w4a16_gemm import quantize_int4_ref, unpack_int4_ref
from kernels.cpu_threads import torch_single_threaded
from tests.kernels.test_kv_store import seed  # noqa: F401  (fixture)

pytestmark = pytest.mark.skipif(not (cpu_moe_experts.available(torch.float32)
                                     or cpu_moe_experts.available(torch.bfloat16)),
                                reason=f"MoE experts kernel not built: {cpu_moe_experts.build_error()}")


def _case(experts: int, hidden: int, inter: int, tokens: int, top_k: int, dtype: torch.dtype):
    """(xs [T*k, H] in expert order, w13 [E, 2I, H], w2 [E, H, I], offsets [E + 1]) of a random routing."""
    w13 = (torch.randn(experts, 2 * inter, hidden) * 0.2).to(dtype)
    w2 = (torch.randn(experts, hidden, inter) * 0.2).to(dtype)
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)])
    layout = sort_by_expert(ids, experts, torch.rand(tokens, top_k))
    xs = (torch.randn(tokens, hidden) * 1.5).to(dtype)[layout.token_index]
    return xs, w13, w2, layout.offsets


def _run(xs, w13, w2, offsets, threads: int) -> torch.Tensor:
    """The kernel with `threads` threads handed to the C kernels (as the grouped path calls it); w13 and w2 None:
    xs and offsets, an `Int4Experts`, for the INT4 entry."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch_single_threaded():
            if isinstance(w13, cpu_moe_experts.Int4Experts):
                return cpu_moe_experts.moe_experts_int4(xs, w13, offsets)
            return cpu_moe_experts.moe_experts(xs, w13, w2, offsets)
    finally:
        torch.set_num_threads(before)


def _int4(w13: torch.Tensor, w2: torch.Tensor, group: int) -> cpu_moe_experts.Int4Experts:
    """The experts' weights quantised to INT4 in the INT4 GEMV's panels."""
    def panels(w: torch.Tensor):
        q, s, z = quantize_int4_ref(w.float(), group)
        return pack(unpack_int4_ref(q), s, z, group)

    return cpu_moe_experts.Int4Experts([panels(w) for w in w13], [panels(w) for w in w2])


SHAPES = {  # experts, hidden, inter, tokens, top_k: many hit experts a thread, few, one, odd widths
    "decode-8": (16, 64, 96, 8, 4),
    "prompt-33": (12, 48, 40, 33, 3),
    "one-token-top2": (8, 64, 32, 1, 2),
    "one-expert": (4, 40, 24, 5, 1),
    "odd-widths": (9, 37, 23, 6, 3),
}


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_float32_matches_float64(shape: tuple, seed: int) -> None:
    if not cpu_moe_experts.available(torch.float32):
        pytest.skip("no float32 GEMV here")
    xs, w13, w2, offsets = _case(*shape, torch.float32)
    got = _run(xs, w13, w2, offsets, 2)
    want = torch.empty_like(got, dtype=torch.float64)
    bound = torch.empty_like(want)
    bounds = offsets.tolist()
    for e in range(w13.shape[0]):
        x = xs[bounds[e]:bounds[e + 1]].double()
        gate, up = (x @ w13[e].double().t()).chunk(2, dim=-1)
        act = F.silu(gate) * up
        want[bounds[e]:bounds[e + 1]] = act @ w2[e].double().t()
        bound[bounds[e]:bounds[e + 1]] = act.abs() @ w2[e].double().abs().t()
    assert ((got.double() - want).abs() <= 1e-5 * bound + 1e-6).all(), f"seed {seed}"


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_bfloat16_is_the_loop_of_its_kernels(shape: tuple, seed: int) -> None:
    if not cpu_moe_experts.available(torch.bfloat16):
        pytest.skip("no bfloat16 GEMV here")
    xs, w13, w2, offsets = _case(*shape, torch.bfloat16)
    _assert_each_expert(_run(xs, w13, w2, offsets, 2), xs, offsets, seed,
                        lambda e, x: cpu_gemv.gemv_bf16(silu_mul_bf16(cpu_gemv.gemv_bf16(x, w13[e], 1)), w2[e], 1))


def _assert_each_expert(got: torch.Tensor, xs: torch.Tensor, offsets: torch.Tensor, seed: int, want) -> None:
    """got's rows of every hit expert e equal want(e, its rows of xs) bit for bit (bfloat16)."""
    bounds = offsets.tolist()
    for e in range(len(bounds) - 1):
        if bounds[e + 1] > bounds[e]:
            rows = slice(bounds[e], bounds[e + 1])
            assert torch.equal(got[rows].view(torch.int16), want(e, xs[rows]).view(torch.int16)), f"seed {seed}"


INT4_SHAPES = {  # experts, hidden, inter, tokens, top_k, group
    "decode-8-g32": (16, 64, 96, 8, 4, 32),
    "prompt-33-g16": (12, 48, 40, 33, 3, 16),
    "one-token-g64": (8, 128, 64, 1, 2, 64),
}


@pytest.mark.parametrize("round_once", [False, True])
@pytest.mark.parametrize("shape", INT4_SHAPES.values(), ids=INT4_SHAPES.keys())
def test_int4_is_the_loop_of_its_kernels(shape: tuple, round_once: bool, seed: int) -> None:
    """Bit for bit the loop of gemv_int4 and the SwiGLU kernel, its activation rounded twice (a bfloat16 model's)
    or once (`round_once`: a float32 model's)."""
    if not cpu_moe_experts.available(cpu_moe_experts.INT4):
        pytest.skip("no INT4 GEMV here")
    *dims, group = shape
    xs, w13, w2, offsets = _case(*dims, torch.bfloat16)
    experts = _int4(w13, w2, group)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch_single_threaded():
            got = cpu_moe_experts.moe_experts_int4(xs, experts, offsets, round_once=round_once)
    finally:
        torch.set_num_threads(before)
    _assert_each_expert(got, xs, offsets, seed, lambda e, x: gemv_int4(
        silu_mul_bf16(gemv_int4(x, experts.panels[0][e], 1), once=round_once), experts.panels[1][e], 1))


@pytest.mark.parametrize("kind", [torch.float32, torch.bfloat16, cpu_moe_experts.INT4])
def test_threads_change_no_bit(kind: torch.dtype | str, seed: int) -> None:
    """Large enough (1.2 MB of float32 experts) for two threads to share the experts out, and a routing with a single
    hit expert, whose calls are split instead."""
    if not cpu_moe_experts.available(kind):
        pytest.skip(f"no {kind} GEMV here")
    for shape in ((16, 64, 96, 8, 4), (16, 64, 96, 2, 1)):
        xs, w13, w2, offsets = _case(*shape, torch.float32 if kind == torch.float32 else torch.bfloat16)
        if kind == cpu_moe_experts.INT4:
            w13, w2 = _int4(w13, w2, 32), None
        one, two = _run(xs, w13, w2, offsets, 1), _run(xs, w13, w2, offsets, 2)
        assert torch.equal(one.view(torch.int16 if one.dtype == torch.bfloat16 else torch.int32),
                           two.view(torch.int16 if two.dtype == torch.bfloat16 else torch.int32)), f"seed {seed}"


def test_rejects_what_it_does_not_take() -> None:
    xs, w13, w2, offsets = _case(4, 32, 16, 3, 2, torch.float32)
    with pytest.raises(ValueError):
        cpu_moe_experts.moe_experts(xs.bfloat16(), w13, w2, offsets)  # dtypes differ
    with pytest.raises(ValueError):
        cpu_moe_experts.moe_experts(xs, w13, w2.transpose(1, 2), offsets)  # down is [E, H, I]
    with pytest.raises(ValueError):
        cpu_moe_experts.moe_experts(xs, w13, w2, offsets.int())
    with pytest.raises(ValueError):
        cpu_moe_experts.moe_experts(xs[:, :16], w13, w2, offsets)
    if cpu_moe_experts.available(cpu_moe_experts.INT4):
        with pytest.raises(ValueError):  # I = 12: not a multiple of the INT4 GEMV's 8-column step
            _int4(*_case(4, 32, 12, 3, 2, torch.float32)[1:3], 32)
        with pytest.raises(ValueError):
            cpu_moe_experts.moe_experts_int4(xs, _int4(w13, w2, 16), offsets)  # float32 xs
