"""GPTQ: INT4 weights chosen against the layer's inputs, in the existing INT4 format.

Round to nearest (RTN) picks each weight's code alone. GPTQ (Frantar et al., 2022)
picks them one input column at a time and pushes each column's rounding error onto the
columns not yet quantised, weighted by how the layer's inputs correlate, so that the
*output* error ||X Wᵀ - X Qᵀ|| stays small rather than the weight error. For a linear
W [N, K] with calibration inputs X [n, K]:

    H = 2 Xᵀ X / n                                  # [K, K], the Hessian of the output error
    H += λ I,  λ = 10% of mean(diag H)              # dampening: H is often singular
    U = cholesky(H⁻¹) (upper)                       # U[i, i:] is row i of the inverse's factor
    for each column i (in blocks of 128, the updates of a block applied lazily):
        q_i = Q(w_i)                                # the INT4 grid of w_i's group (below)
        e_i = (w_i - q_i) / U[i, i]
        w_j -= e_i U[i, j]  for j > i               # columns not yet quantised absorb the error

An input column that is always zero (diag H = 0) gets H[i, i] = 1 and its weights
set to 0: nothing it multiplies can matter. With H = I there is no correlation to
exploit (U is diagonal, every update is zero) and GPTQ *is* RTN, code for code.

**The grid** is `Int4Format`'s (`backend/weight_formats.py`), so the result is stored and
served as any INT4 checkpoint is: asymmetric, group-wise along K (group g, the last
group partial when g does not divide K), ``w = (q - 8) * s + z`` with q in 0..15, where
for a group with minimum lo and maximum hi s = (hi - lo) / 15 and z = lo + 8 s are
rounded to bfloat16 first and the codes computed against the rounded s and z
(`kernels.w4a16_gemm.quantize_int4_ref`, the same float operations, so H = I gives
RTN's codes bit for bit). A group's s and z are set when GPTQ reaches the group's first
column, from the group's current (error-updated) weights, as the GPTQ reference does;
blocks are at least one group wide so that a group never straddles two blocks.

**The symmetric grid** (``symmetric=True``) is compressed-tensors' pack-quantized one
(`backend/compressed_tensors.symmetric_int4`), for checkpoints vLLM and SGLang load: no
zero point, s = bfloat16(max |w| / 7.5) per group (bfloat16's eps for an all-zero
group), q = clamp(round(w / s), -8, 7), stored as code q + 8 with zeros 0; H = I gives
`symmetric_int4`'s codes bit for bit.

**The integer-zero grid** (``integer_zero=True``) is compressed-tensors' asymmetric one
(``symmetric: false``, `backend/compressed_tensors.asymmetric_int4`): the group's range widened
to hold 0, s = bfloat16((hi - lo) / 15), an integer zero point zp = clamp(round(-8 - lo / s),
-8, 7), stored in our layout as z = bfloat16(-zp s); H = I gives `asymmetric_int4` bit for bit.

**Activation order** (``act_order``): columns are visited by decreasing diag H (the
inputs with the most energy first, while there is most freedom left to absorb their
error). The group scales stay in column order (the stored format has no column
permutation), so under act-order every group's s and z are fixed up front from the
weights before any update ("static groups", also available alone), then the columns
are quantised in activation order against them.

**Clip search** (``clip``, static groups): each (row, group) tries its range shrunk
([a lo, b hi] for a, b in 1.0, 0.95 .. 0.5 on the asymmetric grid; p max|w| for p in 1.0,
0.975 .. 0.5 on the symmetric one) and keeps the one whose rounding error of the group,
weighted by the inputs' energy diag H, is least: clipping a few large weights buys a finer step for all the
others, and GPTQ then spreads the clipped weights' error over the later columns. On
SmolLM2 at g128 act-order plus clip is what beats RTN end to end (`BENCHMARKS.md`);
on random-weight test models it can lose to RTN, where plain GPTQ wins.

**Scale refit** (``refit``): with the codes fixed, each row's group scales and zeros are re-fitted
by least squares to the output error through the damped H (`refit_group_params`; on the symmetric
and integer-zero grids only the scales, each zero point staying the same number of steps).
Measured on SmolLM2 g128: ppl 29.08 against 29.13 without (BENCHMARKS.md), so off by default.

Numerics: H is accumulated in float64, inverted and factored in float64 (the
Cholesky of a damped H of a few thousand columns loses nothing there), the column
loop runs in float32. If the Cholesky fails the dampening is raised tenfold, up to
three times, before giving up with a `WeightsError`. The column loop is thousands of
small tensor operations, so it runs on one intra-op thread: with two, the threads'
synchronisation dominated (a [3072, 576] weight took 6.3 s instead of 0.21 s on a
shared 2-core machine); the Hessians and the layer forward keep every thread.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch
import torch.nn.functional as F

from backend.compressed_tensors_write import integer_zero_params
from backend.errors import WeightsError
from backend.weight_formats import Int4Format, StoredWeight
from kernels.exact_div import div_exact

__all__ = ["HessianAccumulator", "PreparedHessian", "GptqResult", "prepare_hessian", "gptq_quantize",
           "int4_group_params", "symmetric_group_params", "integer_zero_group_params", "DEFAULT_DAMP",
           "DEFAULT_BLOCK"]

# Fraction of mean(diag H) added to the diagonal. The GPTQ paper's 1% fits each layer's calibration inputs
# closest; on SmolLM2 g128, GPTQ + the scale tuning on 16,384 tokens came closer to the dense model on held-out
# text at 10% (KL 0.0650, ppl 38.69) than at 1% (0.0690, 38.82), 5% (0.0668) or 20% (0.0671): BENCHMARKS.md.
DEFAULT_DAMP = 0.1
DEFAULT_BLOCK = 128  # columns whose updates are applied together (lazy batch updates)


class HessianAccumulator:
    """H = 2 Xᵀ X / n over every row of X seen by `add` (float64)."""

    def __init__(self, in_features: int) -> None:
        self.h = torch.zeros(in_features, in_features, dtype=torch.float64)  # [K, K]
        self.rows = 0

    def add(self, x: torch.Tensor) -> None:
        """Accumulate inputs x [..., K] (any float dtype)."""
        x = x.reshape(-1, self.h.shape[0]).float()
        self.h += (x.t() @ x).double()
        self.rows += x.shape[0]

    def value(self) -> torch.Tensor:
        """2 Xᵀ X / n [K, K] (float64); an all-zero matrix when nothing was added."""
        return self.h * (2.0 / self.rows) if self.rows else self.h.clone()


class PreparedHessian(NamedTuple):
    """What GPTQ needs of one input's Hessian, shared by every linear that reads that input."""

    u: torch.Tensor  # [K, K] float32, upper Cholesky factor of the damped H⁻¹, rows/columns in visiting order
    perm: torch.Tensor | None  # [K] visiting order (act-order), None: column order
    dead: torch.Tensor  # [K] bool, input columns that were always zero
    diag: torch.Tensor  # [K] float32 diag H in column order (dead columns 1): the clip search's weights
    h: torch.Tensor | None = None  # [K, K] float32 damped H in column order: the scale refit's metric


class GptqResult(NamedTuple):
    stored: StoredWeight  # in the INT4 format (qweight, scales, zeros)
    dequantized: torch.Tensor  # [N, K] float32: exactly Int4Format.dequantize(stored)


def prepare_hessian(h: torch.Tensor, act_order: bool = False, damp: float = DEFAULT_DAMP) -> PreparedHessian:
    """Dampen H [K, K], optionally order its columns by decreasing diagonal, and factor its inverse."""
    h = h.double().clone()
    k = h.shape[0]
    diag = torch.diagonal(h)
    dead = diag == 0
    diag[dead] = 1.0
    diag_cols = diag.float().clone()
    h_cols = h.float() + damp * float(diag.mean()) * torch.eye(k)  # [K, K] column order, damped
    perm = torch.argsort(diag, descending=True, stable=True) if act_order else None
    if perm is not None:
        h = h[perm][:, perm]
    mean = float(torch.diagonal(h).mean())
    for attempt in range(4):
        lam = damp * (10 ** attempt) * mean
        chol, info = torch.linalg.cholesky_ex(h + lam * torch.eye(k, dtype=h.dtype))  # H = L Lᵀ
        if int(info) == 0:
            l_inv = torch.linalg.solve_triangular(chol, torch.eye(k, dtype=h.dtype), upper=False)
            u, info = torch.linalg.cholesky_ex(l_inv.t() @ l_inv, upper=True)  # H⁻¹ = L⁻ᵀ L⁻¹
            if int(info) == 0:
                return PreparedHessian(u.float(), perm, dead, diag_cols, h_cols)
    raise WeightsError(f"GPTQ: the calibration Hessian ({k} columns) is not positive definite even with "
                       f"{100 * damp * 1000:g}% dampening; use more calibration tokens or --method rtn")


def int4_group_params(w: torch.Tensor, shrink: tuple[float, float] = (1.0, 1.0)) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, z) [N] float32 of one INT4 group w [N, g], bfloat16-rounded as `quantize_int4_ref` makes them
    (with `shrink` (a, b) < 1: the range [a lo, b hi], the clip search's candidates)."""
    lo, hi = w.amin(dim=1) * shrink[0], w.amax(dim=1) * shrink[1]
    flat = hi == lo  # a constant group: code 8 stands for the value itself
    s = torch.where(flat, 1.0, div_exact(hi - lo, 15.0)).to(torch.bfloat16)  # as quantize_int4_ref
    z = torch.where(flat, lo, lo + 8 * s.float()).to(torch.bfloat16)
    return s.float(), z.float()


_SYM_STEPS = 7.5  # (q_max - q_min) / 2: compressed-tensors' symmetric scale divisor
_BF16_EPS = torch.finfo(torch.bfloat16).eps  # its scale for an all-zero group


def symmetric_group_params(w: torch.Tensor, shrink: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, 0) [N] float32 of one symmetric group w [N, g], as `symmetric_int4` makes s (`shrink`: amax scaled)."""
    s = div_exact(w.abs().amax(dim=1) * shrink, _SYM_STEPS).to(torch.bfloat16)
    s = torch.where(s == 0, torch.full_like(s, _BF16_EPS), s).float()
    return s, torch.zeros_like(s)


def integer_zero_group_params(w: torch.Tensor, shrink: tuple[float, float] = (1.0, 1.0)) -> tuple[torch.Tensor,
                                                                                                   torch.Tensor]:
    """(s, z) [N] float32 of one group w [N, g] on compressed-tensors' asymmetric grid (an integer zero
    point, `backend.compressed_tensors.integer_zero_params` of the range [a lo, b hi]) with z =
    bfloat16(-zp s), the value of code 8 as our INT4 layout stores it; zp = round(-z / s) recovers zp."""
    s, zp = integer_zero_params(w.amin(dim=1) * shrink[0], w.amax(dim=1) * shrink[1])
    return s, (-zp * s).to(torch.bfloat16).float()


def _grid(symmetric: bool, integer_zero: bool):  # noqa: ANN202 (one of the three params functions)
    if symmetric:
        return symmetric_group_params
    return integer_zero_group_params if integer_zero else int4_group_params


def _codes(w: torch.Tensor, s: torch.Tensor, z: torch.Tensor, symmetric: bool) -> torch.Tensor:
    """INT4 codes (float, 0..15) of w against s, z (broadcast), rounded as the grid's RTN rounds."""
    if symmetric:
        return (w / s).clamp(-8, 7).round() + 8
    return (torch.round((w - z) / s) + 8).clamp(0, 15)


@contextmanager
def _one_thread() -> Iterator[None]:
    """torch's intra-op threads set to 1 inside, restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


CLIP_SHRINKS = tuple(1.0 - 0.025 * i for i in range(21))  # 1.000 .. 0.500: symmetric max|w| shrinks tried
CLIP_SHRINKS_ASYM = tuple((a, b) for a in (1.0 - 0.05 * i for i in range(11))
                          for b in (1.0 - 0.05 * i for i in range(11)))  # (lo, hi) shrinks: 121 pairs


def _static_params(w: torch.Tensor, diag: torch.Tensor, g: int, symmetric: bool,
                   clip: bool, integer_zero: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales, zeros) [N, groups] of w [N, K] from its groups before any update. With `clip`, each
    (row, group) takes the range shrink (`CLIP_SHRINKS_ASYM`: lo and hi shrunk independently;
    `CLIP_SHRINKS` symmetric) whose rounding error, weighted by the inputs' energy diag H, is least."""
    n, k = w.shape
    params = _grid(symmetric, integer_zero)
    groups = -(-k // g)
    scales, zeros = torch.zeros(n, groups), torch.zeros(n, groups)
    for j in range(groups):
        wg, d = w[:, j * g:(j + 1) * g], diag[j * g:(j + 1) * g]
        best = None
        candidates = (CLIP_SHRINKS if symmetric else CLIP_SHRINKS_ASYM) if clip else \
            ((1.0,) if symmetric else ((1.0, 1.0),))
        for shrink in candidates:
            s, z = params(wg, shrink)
            c = _codes(wg, s[:, None], z[:, None], symmetric)
            err = (((c - 8) * s[:, None] + z[:, None] - wg) ** 2 * d).sum(dim=1)  # [N]
            if best is None:
                best, scales[:, j], zeros[:, j] = err, s, z
            else:
                better = err < best
                best = torch.where(better, err, best)
                scales[:, j] = torch.where(better, s, scales[:, j])
                zeros[:, j] = torch.where(better, z, zeros[:, j])
    return scales, zeros


def refit_group_params(w: torch.Tensor, codes: torch.Tensor, h: torch.Tensor, g: int, scales: torch.Tensor,
                       zeros: torch.Tensor, fixed_zero: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales and zeros [N, G] re-fitted to the codes GPTQ chose: per row n, the (s, z) of all its groups
    that minimise the output error (w_n - ŵ_n) H (w_n - ŵ_n)ᵀ with ŵ = (c - 8) s + z (least squares,
    2G unknowns; a ridge of 1e-4 of the system's mean diagonal pulls it toward the current values).
    `fixed_zero` (the symmetric and integer-zero grids): each group's zero point stays a fixed number
    of steps, ŵ = (c - 8 + z / s) s, and only s is fitted. Returned bfloat16-rounded, as stored."""
    n, k = w.shape
    groups = -(-k // g)
    pad = groups * g - k
    q = F.pad(codes - 8 + (zeros / scales).repeat_interleave(g, dim=1)[:, :k] * fixed_zero, (0, pad))  # [N, G g]
    wp = F.pad(w.float(), (0, pad))
    hp = F.pad(h.float(), (0, pad, 0, pad)).view(groups, g, groups * g)  # [G, g, G g]
    u = torch.einsum("nai,aij->naj", q.view(n, groups, g), hp)  # [N, G, G g]: sum_{i in a} q_i H_ij
    m_ss = (u * q[:, None]).view(n, groups, groups, g).sum(-1)  # [N, G, G]
    rhs_s = (u * wp[:, None]).sum(-1)  # [N, G]
    if fixed_zero:
        m, rhs, theta0 = m_ss, rhs_s, scales
    else:
        v = hp.sum(dim=1)  # [G, G g]: sum_{i in a} H_ij
        m_sz = u.view(n, groups, groups, g).sum(-1)  # [N, G, G]
        m_zz = v.view(groups, groups, g).sum(-1).expand(n, groups, groups)
        m = torch.cat([torch.cat([m_ss, m_sz], 2), torch.cat([m_sz.transpose(1, 2), m_zz], 2)], 1)  # [N, 2G, 2G]
        rhs, theta0 = torch.cat([rhs_s, wp @ v.t()], 1), torch.cat([scales, zeros], 1)
    lam = 1e-4 * torch.diagonal(m, dim1=1, dim2=2).mean(dim=1).clamp(min=1e-12)  # [N]
    eye = torch.eye(m.shape[1]).expand_as(m)
    theta = torch.linalg.solve(m.double() + (lam[:, None, None] * eye).double(),
                               (rhs + lam[:, None] * theta0).double()).float()
    bad = ~torch.isfinite(theta).all(dim=1) | (theta[:, :groups] <= 0).any(dim=1)  # keep such rows as they were
    theta = torch.where(bad[:, None], theta0, theta)
    s_new = theta[:, :groups].to(torch.bfloat16).float()
    if fixed_zero:
        return s_new, (zeros / scales * s_new).to(torch.bfloat16).float()  # the same zero point in steps
    return s_new, theta[:, groups:].to(torch.bfloat16).float()


def gptq_quantize(w: torch.Tensor, prepared: PreparedHessian, fmt: Int4Format, block: int = DEFAULT_BLOCK,
                  symmetric: bool = False, static_groups: bool = False, clip: bool = False,
                  integer_zero: bool = False, refit: bool = False) -> GptqResult:
    """Quantise w [N, K] (any float dtype) with GPTQ against `prepared` into `fmt`'s layout (`Int4Format`:
    qweight, scales, zeros), on its asymmetric grid or, `symmetric`, compressed-tensors' symmetric one,
    or, `integer_zero`, compressed-tensors' asymmetric one (module docstring)."""
    if (symmetric or integer_zero) and w.shape[1] % fmt.group_size:
        raise WeightsError(f"a symmetric (pack-quantized) weight needs in_features divisible by the group size "
                           f"{fmt.group_size}; got {list(w.shape)}", shape=list(w.shape))
    with _one_thread():
        result = _gptq(w, prepared, fmt, block, symmetric, static_groups or clip or prepared.perm is not None, clip,
                       integer_zero)
    if not refit:
        return result
    n, k = result.dequantized.shape
    sw = result.stored.tensors
    codes = torch.stack([sw["qweight"] & 15, sw["qweight"] >> 4], dim=-1).reshape(n, -1)[:, :k].float()
    w_cols = w.float().clone()
    w_cols[:, prepared.dead] = 0
    s, z = refit_group_params(w_cols, codes, prepared.h, fmt.group_size, sw["scales"].float(), sw["zeros"].float(),
                              symmetric or integer_zero)
    stored = StoredWeight({"qweight": sw["qweight"], "scales": s.to(torch.bfloat16), "zeros": z.to(torch.bfloat16)},
                          (n, k))
    g = fmt.group_size
    return GptqResult(stored, (codes - 8) * s.repeat_interleave(g, dim=1)[:, :k] + z.repeat_interleave(g, dim=1)[:, :k])


def _gptq(w: torch.Tensor, prepared: PreparedHessian, fmt: Int4Format, block: int, symmetric: bool,
          static: bool, clip: bool, integer_zero: bool) -> GptqResult:
    n, k = w.shape
    if prepared.u.shape != (k, k):
        raise WeightsError(f"GPTQ: a [{n}, {k}] weight against a Hessian of {prepared.u.shape[0]} columns")
    if k % 2:
        raise WeightsError(f"INT4 packs two codes per byte along in_features, so it must be even; got a "
                           f"{[n, k]} weight", shape=[n, k])
    g = fmt.group_size
    groups = -(-k // g)
    block = max(block, g)
    W = w.float().clone()  # [N, K], updated in place
    W[:, prepared.dead] = 0
    scales = torch.zeros(n, groups)  # float32 values of the bfloat16 scales
    zeros = torch.zeros(n, groups)
    perm = prepared.perm
    params = _grid(symmetric, integer_zero)
    if static:  # static groups, from the weights before any update (column order)
        scales, zeros = _static_params(W, prepared.diag, g, symmetric, clip, integer_zero)
    if perm is not None:
        W = W[:, perm]
        col_of = perm.tolist()
    else:
        col_of = list(range(k))
    u = prepared.u
    codes = torch.zeros(n, k)  # in visiting order
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        W1 = W[:, i1:i2].clone()
        err = torch.zeros(n, i2 - i1)
        u1 = u[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = col_of[i1 + i]
            if not static and col % g == 0:  # first column of a group: its grid from the current weights
                scales[:, col // g], zeros[:, col // g] = params(W1[:, i:i + g])
            s, z = scales[:, col // g], zeros[:, col // g]
            wi = W1[:, i]
            c = _codes(wi, s, z, symmetric)
            codes[:, i1 + i] = c
            e = (wi - ((c - 8) * s + z)) / u1[i, i]
            W1[:, i:] -= e.unsqueeze(1) * u1[i, i:].unsqueeze(0)
            err[:, i] = e
        W[:, i2:] -= err @ u[i1:i2, i2:]
    if perm is not None:
        codes = codes[:, torch.argsort(perm)]
    q = codes.to(torch.uint8)  # [N, K] in column order
    qweight = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()
    stored = StoredWeight({"qweight": qweight, "scales": scales.to(torch.bfloat16),
                           "zeros": zeros.to(torch.bfloat16)}, (n, k))
    s_full = scales.repeat_interleave(g, dim=1)[:, :k]
    z_full = zeros.repeat_interleave(g, dim=1)[:, :k]
    return GptqResult(stored, (codes - 8) * s_full + z_full)
