"""The MoE block against transformers' own Glm4Moe MoE module, its paths against each
other, and quantised experts against the dense block on their dequantised weights.

Weights are fresh random tensors at scales other than 1 (transformers leaves the
expert weights uninitialised and the gate at zero, so every tensor is set here). The
correction bias is small and positive: transformers versions differ in how they fill
masked groups (0 or -inf), which only matters when a biased score can go negative.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.nn.functional as F

from backend.gemm_widen import widening_pays
from backend.linear import Int4Linear
from backend.moe import MoEBlock, MoEConfig, route
from backend.moe_experts import (LOOP_MAX_TOKENS, RoutedExperts, fused_moe_args, grouped_mm_available,
                                 sort_by_expert)
from backend.weight_formats import DenseFormat, Fp8Format, Int4Format, WeightFormat

transformers = pytest.importorskip("transformers")
from transformers import Glm4MoeConfig  # noqa: E402
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE  # noqa: E402

FP32 = DenseFormat(torch.float32)
PATHS = ["grouped", "loop"] if grouped_mm_available() else ["loop"]


def hf_moe(experts: int, top_k: int, n_group: int, topk_group: int, norm: bool, scale: float, shared: int,
           hidden: int = 36, inter: int = 20) -> Glm4MoeMoE:
    """transformers' MoE module on a tiny config, every weight random."""
    cfg = Glm4MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, n_routed_experts=experts,
                        num_experts_per_tok=top_k, n_group=n_group, topk_group=topk_group, norm_topk_prob=norm,
                        routed_scaling_factor=scale, n_shared_experts=shared)
    with warnings.catch_warnings():  # n_shared_experts = 0 makes zero-size shared weights
        warnings.simplefilter("ignore", UserWarning)
        moe = Glm4MoeMoE(cfg).eval()
    with torch.no_grad():
        moe.gate.weight.copy_(torch.randn(experts, hidden) * 0.3)
        moe.gate.e_score_correction_bias.copy_(torch.rand(experts) * 0.05)
        moe.experts.gate_up_proj.copy_(torch.randn(experts, 2 * inter, hidden) * 0.15)
        moe.experts.down_proj.copy_(torch.randn(experts, hidden, inter) * 0.2)
        for lin in (moe.shared_experts.gate_proj, moe.shared_experts.up_proj, moe.shared_experts.down_proj):
            lin.weight.copy_(torch.randn_like(lin.weight) * 0.25)
    return moe


def our_block(moe: Glm4MoeMoE, fmt: WeightFormat = FP32, compute_dtype: torch.dtype = torch.float32) -> MoEBlock:
    c = moe.config
    shared = None, None
    if c.n_shared_experts:
        s = moe.shared_experts
        shared = torch.cat([s.gate_proj.weight, s.up_proj.weight]).detach(), s.down_proj.weight.detach()
    cfg = MoEConfig.from_hf(c.to_dict())
    return MoEBlock.build(moe.gate.weight.detach(), moe.gate.e_score_correction_bias, moe.experts.gate_up_proj.detach(),
                          moe.experts.down_proj.detach(), *shared, cfg, fmt, compute_dtype)


CASES = {  # experts, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor, n_shared, tokens
    "groups-top8-shared": (16, 8, 4, 2, True, 2.5, 1, 13),
    "groups-top2-nonorm": (16, 2, 4, 3, False, 1.7, 0, 9),
    "top1-idle-experts": (12, 1, 1, 1, True, 0.8, 1, 3),
    "8groups-top8-nonorm-2shared": (32, 8, 8, 3, False, 2.827, 2, 21),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_routing_and_output_match_transformers(case: tuple) -> None:
    *hf_args, tokens = case
    moe = hf_moe(*hf_args)
    block = our_block(moe)
    x = torch.randn(tokens, moe.config.hidden_size) * 1.7
    with torch.no_grad():
        _, ref_w, ref_ids = moe.gate(x)
        ref = moe(x[None])[0]
    ids, w = block.route(x)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == (tokens, hf_args[1])
    order, ref_order = ids.sort(dim=1), ref_ids.sort(dim=1)
    assert torch.equal(order.values, ref_order.values)
    torch.testing.assert_close(w.gather(1, order.indices), ref_w.gather(1, ref_order.indices), rtol=1e-6, atol=1e-7)
    if hf_args[2] > 1:  # every pick lies in one of topk_group groups
        groups = ids // (hf_args[0] // hf_args[2])
        assert all(len(set(row)) <= hf_args[3] for row in groups.tolist())
    if tokens * hf_args[1] < hf_args[0]:
        assert ids.unique().numel() < hf_args[0]  # some experts get no token
    assert sorted(block.experts.paths) == sorted(PATHS)
    for path in PATHS:
        out = block(x, path=path)
        assert out.shape == x.shape and out.dtype == torch.float32
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_unaligned_shapes_take_the_loop() -> None:
    """torch._grouped_mm needs 16-byte strides: hidden 38 in float32 (152 bytes) has none."""
    moe = hf_moe(8, 2, 2, 1, True, 1.3, 1, hidden=38, inter=20)
    block = our_block(moe)
    assert block.experts.paths == ("loop",)
    with pytest.raises(ValueError, match="not available"):
        block(torch.randn(2, 38), path="grouped")
    x = torch.randn(6, 38)
    with torch.no_grad():
        torch.testing.assert_close(block(x), moe(x[None])[0], rtol=1e-5, atol=1e-5)


def test_group_limit_excludes_the_best_expert_of_a_masked_group() -> None:
    """Group 1 holds the single best expert, but group 0's top-2 sum is larger: with one
    group allowed, the best expert is out; with both allowed it is in."""
    h = 8
    x = torch.randn(1, h) * 2
    logits = torch.tensor([[2.0, 1.9, -3.0, -3.0, 3.0, -4.0, -4.0, -4.0]])  # groups of 4
    gate = torch.linalg.lstsq(x, logits).solution.t()  # [E, H] with x @ gate.T = logits
    limited = route(x, gate, None, MoEConfig(8, 2, n_group=2, topk_group=1))
    free = route(x, gate, None, MoEConfig(8, 2, n_group=2, topk_group=2))
    assert sorted(limited.topk_ids[0].tolist()) == [0, 1]
    assert sorted(free.topk_ids[0].tolist()) == [0, 4]
    s = torch.sigmoid(logits[0])
    torch.testing.assert_close(limited.topk_weights.sum(), torch.tensor(1.0))
    assert torch.allclose(free.topk_weights.sort().values, (s[[0, 4]] / s[[0, 4]].sum()).sort().values)


def test_correction_bias_selects_but_does_not_weigh() -> None:
    x = torch.randn(5, 24)
    gate = torch.randn(6, 24)
    bias = torch.zeros(6)
    bias[3] = 10.0  # expert 3 always chosen
    r = route(x, gate, bias, MoEConfig(6, 2, norm_topk_prob=False, routed_scaling_factor=3.0))
    assert (r.topk_ids == 3).any(dim=1).all()
    s = torch.sigmoid(x @ gate.t())
    torch.testing.assert_close(r.topk_weights, 3.0 * s.gather(1, r.topk_ids))


def test_sort_by_expert_layout() -> None:
    t, k, e = 11, 3, 9
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    w = torch.rand(t, k) + 0.1
    lay = sort_by_expert(ids, e, w)
    assert lay.offsets.shape == (e + 1,) and lay.offsets[0] == 0 and lay.offsets[-1] == t * k
    assert torch.equal(lay.offsets.diff(), torch.bincount(ids.reshape(-1), minlength=e))
    for expert in range(e):
        run = lay.token_index[lay.offsets[expert]: lay.offsets[expert + 1]]
        assert torch.equal(run, (ids == expert).any(dim=1).nonzero().squeeze(1))  # its tokens, in order
        for tok, weight in zip(run.tolist(), lay.slot_weight[lay.offsets[expert]: lay.offsets[expert + 1]].tolist()):
            assert weight == w[tok][ids[tok] == expert].item()


def test_idle_experts_cost_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the loop path INT4 experts run one Int4Linear pair per *hit* expert."""
    moe = hf_moe(16, 2, 1, 1, True, 1.0, 0, hidden=64, inter=32)
    block = our_block(moe, Int4Format(32))
    calls = []
    original = Int4Linear.__call__
    monkeypatch.setattr(Int4Linear, "__call__", lambda self, x: calls.append(x.shape[0]) or original(self, x))
    x = torch.randn(3, 64)
    block(x, path="loop")
    hit = block.route(x).topk_ids.unique().numel()
    assert hit < 16 and len(calls) == 2 * hit and sum(calls) == 2 * 3 * 2


def _dequantised_experts(fmt: WeightFormat, moe: Glm4MoeMoE) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts' dequantised weights [E, 2I, H], [E, H, I] as `fmt` stores them."""
    gu = torch.stack([fmt.dequantize(fmt.quantize(w)) for w in moe.experts.gate_up_proj.detach()])
    dn = torch.stack([fmt.dequantize(fmt.quantize(w)) for w in moe.experts.down_proj.detach()])
    return gu, dn


@pytest.mark.parametrize("path", PATHS)
def test_fp8_experts_equal_the_dense_block_on_dequantised_weights(path: str) -> None:
    moe = hf_moe(16, 4, 2, 1, True, 2.0, 1, hidden=136, inter=72)  # partial 128-blocks
    fmt = Fp8Format()
    block = our_block(moe, fmt)
    gu, dn = _dequantised_experts(fmt, moe)
    s = moe.shared_experts
    dense = MoEBlock.build(moe.gate.weight.detach(), moe.gate.e_score_correction_bias, gu, dn,
                           fmt.dequantize(fmt.quantize(torch.cat([s.gate_proj.weight, s.up_proj.weight]).detach())),
                           fmt.dequantize(fmt.quantize(s.down_proj.weight.detach())), block.cfg, FP32, torch.float32)
    x = torch.randn(9, 136) * 0.6
    out, ref = block(x, path=path), dense(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        assert (out - moe(x[None])[0]).abs().max() > 1e-4  # the weights really are quantised


def test_int4_experts_equal_the_dense_block_on_dequantised_weights() -> None:
    """INT4 experts read bfloat16 activations and write bfloat16 (the CPU INT4 GEMM): the
    reference rounds at the same places and runs float32 GEMMs on the dequantised weights."""
    moe = hf_moe(16, 4, 4, 2, False, 1.5, 0, hidden=96, inter=40)
    fmt = Int4Format(32)
    block = our_block(moe, fmt)
    gu, dn = _dequantised_experts(fmt, moe)
    x = torch.randn(7, 96) * 1.3
    ids, w = block.route(x)
    bf = lambda t: t.bfloat16().float()  # noqa: E731
    ref = torch.zeros(7, 96)
    bound = torch.zeros(7, 96)  # |terms| summed: the scale a bf16 rounding flip moves
    for t in range(7):
        for e, weight in zip(ids[t].tolist(), w[t].tolist()):
            gate, up = bf(bf(x[t]) @ gu[e].t()).chunk(2)
            act = bf(F.silu(gate) * up)
            ref[t] += weight * bf(act @ dn[e].t())
            bound[t] += abs(weight) * (act.abs() @ dn[e].abs().t())
    out = block(x)
    assert ((out - ref).abs() <= 2.0 ** -7 * bound + 1e-6).all()
    assert (out - ref).abs().max() < 0.05 * (out - moe(x[None])[0].detach()).abs().max()  # far below quantisation


def test_bf16_compute_paths_agree() -> None:
    moe = hf_moe(16, 4, 1, 1, True, 2.5, 1, hidden=48, inter=24)
    block = our_block(moe, DenseFormat(torch.bfloat16), torch.bfloat16)
    assert sorted(block.experts.paths) == sorted(PATHS)
    x = torch.randn(10, 48).bfloat16()
    outs = [block(x, path=p) for p in PATHS]
    assert all(o.dtype == torch.bfloat16 for o in outs)
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], rtol=2e-2, atol=2e-2)
    with torch.no_grad():
        ref = moe(x.float()[None])[0]
    assert (outs[0].float() - ref).norm() < 2e-2 * ref.norm()  # bfloat16 roundings only


def test_nbytes_counts_every_weight() -> None:
    e, h, i = 16, 64, 32
    moe = hf_moe(e, 2, 1, 1, True, 1.0, 1, hidden=h, inter=i)
    dense, int4 = our_block(moe), our_block(moe, Int4Format(32))
    assert dense.nbytes == 4 * (e * h + e + e * 3 * h * i + 3 * h * i)
    gate = 4 * (e * h + e)
    assert gate + (dense.nbytes - gate) / 8 < int4.nbytes < gate + (dense.nbytes - gate) / 4


def test_config_rejects_impossible_routing() -> None:
    with pytest.raises(ValueError, match="n_group"):
        MoEConfig(10, 2, n_group=4)
    with pytest.raises(ValueError, match="top_k"):
        MoEConfig(16, 5, n_group=4, topk_group=1)
    with pytest.raises(ValueError, match="topk_group"):
        MoEConfig(16, 2, n_group=4, topk_group=5)


@pytest.mark.parametrize("fmt", [FP32, DenseFormat(torch.bfloat16), Fp8Format(), Int4Format(32)], ids=repr)
def test_kernel_arguments_fit_the_fused_moe_reference(fmt: WeightFormat) -> None:
    """What the block hands the CUDA kernel, checked on CPU by the kernel's torch reference."""
    fused_moe = pytest.importorskip("kernels.fused_moe")
    moe = hf_moe(8, 2, 1, 1, True, 1.5, 0, hidden=64, inter=40)
    block = our_block(moe, fmt)
    gu = [fmt.quantize(w) for w in moe.experts.gate_up_proj.detach()]
    dn = [fmt.quantize(w) for w in moe.experts.down_proj.detach()]
    w13, w2, kwargs = fused_moe_args(fmt, gu, dn)
    x = torch.randn(5, 64)
    ids, w = block.route(x)
    dequantised = [[FP32.quantize(fmt.dequantize(sw)) for sw in part] for part in (gu, dn)]
    expected = RoutedExperts(FP32, *dequantised, torch.float32)(x, ids, w, "loop")  # float32 GEMMs, as the kernel
    torch.testing.assert_close(fused_moe.fused_moe_ref(x, w13, w2, w, ids, **kwargs), expected, rtol=1e-5, atol=1e-5)
    if os.environ.get("TRITON_INTERPRET") == "1":  # the kernel itself, interpreted on CPU tensors
        torch.testing.assert_close(fused_moe.fused_moe(x, w13, w2, w, ids, **kwargs), expected, rtol=1e-5,
                                   atol=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available(),
                    reason="needs a CUDA device and TRITON_INTERPRET=0")
@pytest.mark.parametrize("fmt", [FP32, DenseFormat(torch.bfloat16), Fp8Format(), Int4Format(32)], ids=repr)
def test_cuda_block_runs_the_fused_kernel(fmt: WeightFormat) -> None:
    """The block quantised on the GPU runs the fused kernel and gives the CPU block's output.

    Both quantise to the same stored weights (no division by a Python scalar, which CUDA runs as a product with
    its reciprocal). The fused kernel computes float32 x in float32; the CPU's bfloat16 and INT4 experts round
    their activations to bfloat16, so those compare to within bfloat16 rounding of the output's scale (a sum of
    nine experts cancels: per element, the error is relative to its terms, not to itself); float32 and FP8 (which
    the CPU dequantises to float32 at load) to float32 rounding."""
    moe = hf_moe(32, 8, 4, 2, True, 2.5, 1, hidden=256, inter=128)
    cpu = our_block(moe, fmt)
    gpu = our_block(moe.cuda(), fmt)
    assert gpu.experts.paths == ("fused",)
    x = torch.randn(37, 256)
    want = cpu(x)
    tol = 1e-2 if isinstance(fmt, Int4Format) or fmt.name == "bf16" else 1e-4  # the CPU off by <= 0.52% of scale
    torch.testing.assert_close(gpu(x.cuda()).cpu(), want, rtol=tol, atol=tol * float(want.abs().max()))


def test_dense_experts_run_one_c_call_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dense CPU experts are `Linear` views of the stacked weights (one copy); bfloat16 and float32 ones default to
    the grouped path, which up to the C GEMV's row limit is one C call with torch's threads handed over, its
    output the loop's; past it bfloat16 experts take the loop (up to LOOP_MAX_TOKENS) and then grouped GEMMs."""
    from kernels import cpu_gemv, cpu_gemv_f32, cpu_moe_experts
    from kernels.cpu_threads import kernels_own_threads

    moe = hf_moe(8, 2, 1, 1, True, 1.0, 0, hidden=64, inter=32)
    for dtype in (torch.float32, torch.bfloat16):
        experts = our_block(moe, DenseFormat(dtype), dtype).experts
        assert all(a.weight.data_ptr() == experts.w13[e].data_ptr()
                   and b.weight.data_ptr() == experts.w2[e].data_ptr() for e, (a, b) in enumerate(experts.ops))
        c_rows = experts.ops[0][0].gemv_rows if cpu_moe_experts.available(dtype) and "grouped" in PATHS else 0
        assert c_rows == 0 or c_rows == (cpu_gemv_f32.max_rows() if dtype == torch.float32 else cpu_gemv.max_rows())
        assert experts.c_rows == c_rows
        assert experts.default_path(3) == ("grouped" if c_rows else experts.paths[0])
        past = "loop" if dtype == torch.bfloat16 and experts.ops[0][0].gemv else PATHS[0]
        assert experts.default_path(max(c_rows, 3) + 1) == past
        # a long prompt: grouped GEMMs where they run, but bfloat16 experts stay on the loop where bfloat16 GEMMs are
        # emulated (`widening_pays`, forced both ways here and forgotten after)
        try:
            for emulated in (False, True):
                monkeypatch.setenv("EDGESERVE_BF16_WIDEN", str(int(emulated)))
                widening_pays.cache_clear()
                loop = emulated and dtype == torch.bfloat16 and experts.ops[0][0].gemv
                assert experts.default_path(LOOP_MAX_TOKENS + 1) == ("loop" if loop else PATHS[0])
        finally:
            monkeypatch.delenv("EDGESERVE_BF16_WIDEN")
            widening_pays.cache_clear()
        if not c_rows:
            continue
        calls: list[bool] = []
        real = cpu_moe_experts.moe_experts

        def counted(*args: object) -> torch.Tensor:
            calls.append(kernels_own_threads())
            return real(*args)

        monkeypatch.setattr(cpu_moe_experts, "moe_experts", counted)
        block = our_block(moe, DenseFormat(dtype), dtype)
        x = torch.randn(3, 64).to(dtype)
        threads = torch.get_num_threads()
        torch.set_num_threads(2)  # a handover needs threads to hand over (an earlier test may have left torch at 1)
        try:
            out = block(x)
        finally:
            torch.set_num_threads(threads)
        assert calls == [True]
        loop = block(x, path="loop")
        if dtype == torch.bfloat16:  # the same GEMVs and activation: the loop's bits
            assert torch.equal(out.view(torch.int16), loop.view(torch.int16))
        else:
            torch.testing.assert_close(out, loop, rtol=1e-5, atol=1e-6)
        monkeypatch.undo()


def test_int4_experts_run_one_c_call_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """INT4 experts whose panels the C call takes default to it at every size, with torch's threads handed over;
    under bfloat16 compute its output is the loop's bit for bit, under float32 compute it differs from the loop only
    where the C and torch float32 silu round the product to different bfloat16 values (its activation is rounded
    once, as the loop's)."""
    from kernels import cpu_moe_experts
    from kernels.cpu_threads import kernels_own_threads

    moe = hf_moe(16, 4, 1, 1, True, 1.0, 1, hidden=64, inter=32)
    experts = our_block(moe, Int4Format(32)).experts
    if not (cpu_moe_experts.available(cpu_moe_experts.INT4) and experts.ops[0][0].gemv):
        assert experts.paths == ("loop",) and experts.default_path(3) == "loop"
        pytest.skip(f"no INT4 C GEMV here: {cpu_moe_experts.build_error()}")
    assert experts.paths == ("grouped", "loop") and experts.default_path(1 << 20) == "grouped"
    calls: list[bool] = []
    real = cpu_moe_experts.moe_experts_int4

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(kernels_own_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_moe_experts, "moe_experts_int4", counted)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # a handover needs threads to hand over (an earlier test may have left torch at 1)
    try:
        for dtype in (torch.bfloat16, torch.float32):
            block = our_block(moe, Int4Format(32), dtype)
            x = torch.randn(5, 64).to(dtype)
            out, loop = block(x), block(x, path="loop")
            if dtype == torch.bfloat16:
                assert torch.equal(out.view(torch.int16), loop.view(torch.int16))
            else:
                assert (out - loop).norm() < 1e-4 * loop.norm()  # two roundings to bfloat16 were ~1e-3
    finally:
        torch.set_num_threads(threads)
    assert calls == [True, True]


def test_past_the_c_calls_rows_the_routing_decides(monkeypatch: pytest.MonkeyPatch) -> None:
    """More tokens than the C call's rows: it still runs where the routing leaves every expert within them (16
    experts, top-2), and `torch._grouped_mm` where one expert holds more (2 experts, top-2: each holds every token);
    both match transformers."""
    from kernels import cpu_moe_experts

    if "grouped" not in PATHS:
        pytest.skip("no torch._grouped_mm on the CPU here")
    calls: list[int] = []
    real = cpu_moe_experts.moe_experts
    monkeypatch.setattr(cpu_moe_experts, "moe_experts", lambda *args: calls.append(args[0].shape[0]) or real(*args))
    for experts, c_call in ((16, True), (2, False)):
        moe = hf_moe(experts, 2, 1, 1, True, 1.0, 1, hidden=32, inter=16)
        block = our_block(moe)
        tokens = block.experts.c_rows + 1
        x = torch.randn(tokens, 32)
        with torch.no_grad():
            ref = moe(x[None])[0]
        calls.clear()
        torch.testing.assert_close(block(x), ref, rtol=1e-5, atol=1e-5)
        assert calls == ([2 * tokens] if c_call and block.experts.c_rows else [])


def test_a_block_says_whether_the_c_gemv_runs_all_of_it() -> None:
    """INT4 experts on the loop of C GEMVs, or dense ones on the grouped C call, with a shared expert on C GEMVs
    too: the engine may hand a small step's threads over (`gemv`, `gemv_rows`); float32 experts qualify only where
    the C call builds (else grouped GEMMs)."""
    from kernels import cpu_gemv, cpu_gemv_f32

    moe = hf_moe(8, 2, 1, 1, True, 1.0, 1, hidden=64, inter=32)
    for block in (our_block(moe, DenseFormat(torch.bfloat16), torch.bfloat16),
                  our_block(moe, Int4Format(32), torch.bfloat16)):
        c_kernels = block.experts.ops[0][0].gemv and block.shared_gate_up.gemv
        assert block.gemv == c_kernels and block.gemv_rows == (cpu_gemv.max_rows() if c_kernels else 0)
    fp32 = our_block(moe)
    c_call = bool(fp32.experts.c_rows) and fp32.shared_gate_up.gemv
    assert fp32.gemv == c_call and fp32.gemv_rows == (cpu_gemv_f32.max_rows() if c_call else 0)
