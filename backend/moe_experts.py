"""The routed experts of an MoE layer: the token layout by expert, and the paths that run them.

Every expert is a SwiGLU MLP, ``down(silu(gate(x)) * up(x))``, stored as transformers
v5 fuses it: gate_up [2I, H] (gate rows first, then up rows) and down [H, I], per
expert, in one of the project's weight formats (`backend/weight_formats.py`).

**Layout** (`sort_by_expert`): the T*k (token, choice) slots are sorted by expert,
stably (token order inside an expert), with offsets [E + 1] so that expert e's slots
are rows offsets[e]..offsets[e+1] of the gathered activations. An expert with no slot
has an empty run and costs nothing on any path. The Triton kernel
(`kernels/fused_moe.py`) pads the same runs to its BLOCK_M.

**Paths** (chosen per call; `default_path` picks one by what the weights allow):
- ``grouped`` (CPU, dense weights): every expert in one call. Up to the C GEMV's row limit
  (`c_rows`: an expert holds at most one slot a token, so a call of that many tokens keeps
  every expert within it; a longer prompt takes it too where its routing does, e.g. 512
  tokens top-8 over 64 experts, ~64 slots each) one C call (`kernels/cpu_moe_experts.py`)
  runs each hit expert's two GEMVs and its SwiGLU activation, the hit experts shared out
  between the threads, with torch's threads handed over to it: the default for bfloat16, float32 and INT4 experts
  alike where it builds (INT4 experts at every size, on bfloat16 activations, as
  `Int4Linear` runs them). Past the limit, two `torch._grouped_mm` calls over all E experts
  with ``offs`` = offsets[1:] as int32 (fp32 and bf16 both accepted), on the transposed
  views of the weights stacked as stored (w13 [E, 2I, H], w2 [E, H, I]), the layout
  transformers' own grouped experts use. It needs every stride a multiple of 16 bytes
  (H and I multiples of 4 in float32, of 8 in bfloat16); other shapes take the loop.
  Dense means fp32/bf16 weights, and FP8 ones, which the CPU dequantises at load into
  the compute dtype (it has no FP8 GEMM). torch's CPU kernel is a loop of GEMMs over
  the groups. The default for float32 experts past the C call's limit.
- ``loop`` (any format): one GEMM pair per hit expert on its contiguous slice of
  the sorted tokens. Dense experts are `Linear`s on slices of the stacks, so an
  expert's rows run the C GEMV (`kernels/cpu_gemv.py`, `kernels/cpu_gemv_f32.py`) up
  to its row limit and MKL past it; INT4 runs one `Int4Linear` per expert (bfloat16
  activations, see `linear.py`). The default for bfloat16 experts past the C call's
  limit up to `LOOP_MAX_TOKENS` tokens a call (grouped GEMMs past it: a 512-token
  prompt ran 13% slower on the loop on an AVX-512 BF16 host; where bfloat16 GEMMs are
  emulated, `gemm_widen.widening_pays`, the loop at every size: torch's grouped GEMMs
  took 5x its time at 256-512 tokens on an AVX2 host), and for experts the C call does
  not take.
- ``fused`` (CUDA): `kernels.fused_moe.fused_moe` on the stacked stored tensors in
  the checkpoint layout (w13 [E, 2I, ...], w2 [E, H, ...]) with their scales.

Measured (`edgeserve bench moe`'s layer, hidden 1024, 64 experts of 512, top-8, one
shared expert, 15 rounds; ms at 1 / 8 / 32 / 256 tokens). The C call, on a 2-core AMD
EPYC VM with AVX2 only: float32 3.5 / 13.4 / 22.4 (torch's grouped GEMMs 5.1 / 24.0 /
53.8, the loop 3.8 / 18.2 / 29.7), INT4 1.2 / 4.0 / 11.8 / 81.8 (the loop 2.7 / 8.3 /
20.8 / 101.1); decode of the bench's 8-layer model 1.3-2.8x faster in all three formats
(BENCHMARKS.md). Before it, on a 2-core Intel Xeon VM with AMX:
float32, grouped on the stored layout 3.4 / 13.2 / 29.2 / 62.5 where the K-major stack
this path used before gave 2.9 / 15.6 / 35.9 / 67.4 (transformers 3.7 / 13.2 / 28.3 /
71.0), the loop on the float32 C GEMV 5.0 / 20.4 / 31.6 / 87.6 (MKL's transposed GEMMs
win in float32); bfloat16 (an ad-hoc A/B in one process), grouped 3.5 / 14.0 / 22.5 /
30.1 against the loop 2.7 / 13.6 / 19.9 / 29.7, and 2.1 / 9.5 / 17.2 with torch's
threads handed over for the whole call as a decode step hands them (grouped 4.8 / 23.0
/ 35.6 so).

Each path returns the *unweighted* expert outputs per sorted slot (CPU) or the
weighted sum (fused); `RoutedExperts.__call__` applies the routing weights and sums
over the k choices in float32.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from functools import cache
from typing import NamedTuple

import torch

from backend.gemm_widen import widening_pays
from backend.layers.swiglu import swiglu
from backend.linear import Linear, LinearOp
from backend.weight_formats import DenseFormat, Fp8Format, Int4Format, StoredWeight, WeightFormat
from kernels import cpu_moe_experts
from kernels.cpu_threads import torch_single_threaded

__all__ = ["ExpertLayout", "sort_by_expert", "RoutedExperts", "PATHS", "ANY_ROWS", "LOOP_MAX_TOKENS",
           "grouped_mm_available", "fused_format_name", "fused_moe_args"]

PATHS = ("grouped", "loop", "fused")
# bfloat16 experts: the C GEMV loop up to this many tokens a call, grouped GEMMs past it (module doc: even at 256,
# grouped ahead at 512-token prompts)
LOOP_MAX_TOKENS = 256
ANY_ROWS = 1 << 31  # `RoutedExperts.c_rows` of INT4 experts: their C GEMV takes every row count, as `Int4Linear`'s


class ExpertLayout(NamedTuple):
    """The T*k routing slots sorted by expert (see the module docstring)."""

    token_index: torch.Tensor  # [T*k] int64: the token of each sorted slot
    slot_weight: torch.Tensor  # [T*k] float32: its routing weight
    offsets: torch.Tensor  # [E + 1] int64: expert e owns sorted slots offsets[e]..offsets[e+1]-1


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int, topk_weights: torch.Tensor) -> ExpertLayout:
    """Sort the slots of topk_ids [T, k] (int, in 0..num_experts-1) and their weights
    topk_weights [T, k] by expert, stably."""
    flat = topk_ids.reshape(-1).long()  # [T*k] expert of slot s = t*k + j
    order = torch.argsort(flat, stable=True)  # [T*k]
    counts = torch.bincount(flat, minlength=num_experts)  # [E]
    offsets = torch.zeros(num_experts + 1, dtype=torch.long, device=flat.device)
    torch.cumsum(counts, 0, out=offsets[1:])
    return ExpertLayout(order // topk_ids.shape[1], topk_weights.reshape(-1).float()[order], offsets)


@cache
def grouped_mm_available() -> bool:
    """True when this torch has `torch._grouped_mm` with a CPU kernel (2.9 onwards)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        torch._grouped_mm(torch.ones(4, 4), torch.ones(1, 4, 4), offs=torch.tensor([4], dtype=torch.int32))
    except (RuntimeError, NotImplementedError):
        return False
    return True


def fused_format_name(fmt: WeightFormat) -> str | None:
    """The name `kernels.fused_moe` knows `fmt` by, or None when it has no kernel for it."""
    if isinstance(fmt, DenseFormat):
        return fmt.name if fmt.dtype in (torch.float32, torch.bfloat16) else None
    return fmt.name if isinstance(fmt, (Fp8Format, Int4Format)) else None


def fused_moe_args(fmt: WeightFormat, gate_up: Sequence[StoredWeight], down: Sequence[StoredWeight]
                   ) -> tuple[torch.Tensor, torch.Tensor, dict[str, object]]:
    """(w13, w2, keyword arguments) of `kernels.fused_moe.fused_moe` for experts stored in
    `fmt`: each stored tensor stacked over experts, in the checkpoint's [N, K] layout."""
    args: dict[str, object] = {"fmt": fused_format_name(fmt)}
    stacked = []
    for name, parts in (("w13", gate_up), ("w2", down)):
        if isinstance(fmt, Fp8Format) and len({p.tensors["weight_scale_inv"].shape for p in parts}) > 1:
            parts = [fmt.rowwise(p) for p in parts]  # some experts were row-expanded at load: all of them
        t = {s: torch.stack([p.tensors[s] for p in parts]) for s in parts[0].tensors}
        if isinstance(fmt, Int4Format):
            stacked.append(t["qweight"])  # [E, N, K/2] uint8
            args[f"{name}_scale"], args[f"{name}_zeros"] = t["scales"], t["zeros"]  # [E, N, ceil(K/g)]
        else:
            stacked.append(t["weight"])  # [E, N, K]
            if isinstance(fmt, Fp8Format):
                args[f"{name}_scale"] = t["weight_scale_inv"]  # [E, ceil(N/128) or N, ceil(K/128)]
    if isinstance(fmt, Int4Format):
        args["group_size"] = fmt.group_size
    return stacked[0], stacked[1], args


class RoutedExperts:
    """E SwiGLU experts in one weight format, built from their stored weights.

    gate_up[e] is expert e's [2I, H] weight, down[e] its [H, I]. On CPU the weights
    become runtime GEMMs through `fmt.linear`; when those are dense they are stacked as
    stored, each expert's `Linear` a view of the stacks (one copy). On CUDA, formats the
    fused kernel takes are stacked as stored."""

    def __init__(self, fmt: WeightFormat, gate_up: Sequence[StoredWeight], down: Sequence[StoredWeight],
                 compute_dtype: torch.dtype) -> None:
        if not gate_up or len(gate_up) != len(down):
            raise ValueError(f"need one gate_up and one down weight per expert, got {len(gate_up)} and {len(down)}")
        (two_i, h), (h2, i) = gate_up[0].shape, down[0].shape
        if two_i != 2 * i or h2 != h or any(g.shape != (two_i, h) for g in gate_up) \
                or any(d.shape != (h, i) for d in down):
            raise ValueError(f"expert weights must all be gate_up [2I, H] and down [H, I]; got {gate_up[0].shape} "
                             f"and {down[0].shape} for expert 0")
        self.num_experts, self.hidden_size, self.intermediate_size = len(gate_up), h, i
        self.fmt, self.compute_dtype = fmt, compute_dtype
        self.device = next(iter(gate_up[0].tensors.values())).device
        self.w13: torch.Tensor | None = None  # CPU dense: [E, 2I, H]; CUDA fused: [E, 2I, ...]; both as stored
        self.w2: torch.Tensor | None = None  # CPU dense: [E, H, I]; CUDA fused: [E, H, ...]
        self.fused_args: dict[str, object] = {}  # CUDA: fused_moe's fmt, scales, zeros and group size
        self.ops: list[tuple[LinearOp, LinearOp]] = []  # per-expert (gate_up, down) for the loop path
        self.c_rows = 0  # tokens up to which the grouped path is one C call (`kernels/cpu_moe_experts.py`); 0: never
        if self.device.type == "cuda" and fused_format_name(fmt) is not None:
            self.w13, self.w2, self.fused_args = fused_moe_args(fmt, gate_up, down)
            self.paths: tuple[str, ...] = ("fused",)
            return
        ops = [(fmt.linear(g, None, compute_dtype), fmt.linear(d, None, compute_dtype)) for g, d in zip(gate_up, down)]
        self.ops = ops
        self.paths = ("loop",)
        self.int4: cpu_moe_experts.Int4Experts | None = None  # INT4 experts' panels for the grouped C call
        if all(getattr(a, "panels", None) is not None and getattr(b, "panels", None) is not None for a, b in ops) \
                and cpu_moe_experts.available(cpu_moe_experts.INT4):
            with contextlib.suppress(ValueError):  # shapes the C call does not take keep the loop
                self.int4 = cpu_moe_experts.Int4Experts([a.panels for a, _ in ops], [b.panels for _, b in ops])
                self.paths, self.c_rows = ("grouped", "loop"), ANY_ROWS
        if self.device.type == "cpu" and all(type(a) is Linear and type(b) is Linear for a, b in ops):
            self.w13 = torch.stack([a.weight for a, _ in ops])  # [E, 2I, H]
            self.w2 = torch.stack([b.weight for _, b in ops])  # [E, H, I]
            self.ops = [(Linear(self.w13[e]), Linear(self.w2[e])) for e in range(len(ops))]  # views: one copy
            row_bytes = [n * self.w13.element_size() for n in (h, i)]  # grouped GEMMs need 16-byte strides
            if all(b % 16 == 0 for b in row_bytes) and grouped_mm_available():
                c_first = self.w13.dtype == torch.bfloat16 and self.ops[0][0].gemv  # measured: module doc
                self.paths = ("loop", "grouped") if c_first else ("grouped", "loop")
                if cpu_moe_experts.available(self.w13.dtype):
                    self.c_rows = self.ops[0][0].gemv_rows  # the C GEMV's limit, past which torch's GEMMs win

    @property
    def nbytes(self) -> int:
        """Bytes of expert weights held (scales and zeros included)."""
        tensors = [t for t in (self.w13, self.w2) if t is not None]
        tensors += [t for t in self.fused_args.values() if isinstance(t, torch.Tensor)]
        ops = self.ops if self.w13 is None else []  # dense CPU experts' ops are views of w13 and w2
        return sum(t.numel() * t.element_size() for t in tensors) + sum(a.nbytes + b.nbytes for a, b in ops)

    def default_path(self, tokens: int) -> str:
        """The path to run `tokens` tokens on before they are routed: fused on CUDA; on the CPU grouped where that is
        one C call whatever the routing (`c_rows`), else the loop where the dense experts have the C GEMV (up to
        LOOP_MAX_TOKENS tokens; past them grouped GEMMs, unless this CPU's bfloat16 GEMMs are emulated:
        `widening_pays`), else grouped GEMMs where the weights are dense, else the loop. `__call__` takes the C
        call past `c_rows` tokens too where the routing leaves every expert within them."""
        if tokens <= self.c_rows:
            return "grouped"
        if self.paths[0] == "loop" and tokens > LOOP_MAX_TOKENS and "grouped" in self.paths and not widening_pays():
            return "grouped"
        return self.paths[0]

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 path: str | None = None) -> torch.Tensor:
        """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]) for x [T, H] -> [T, H] float32. Without `path`,
        `default_path`'s, or grouped where the routing leaves every expert within the C call's rows."""
        tokens = x.shape[0]
        chosen = path or self.default_path(tokens)
        if chosen not in self.paths:
            raise ValueError(f"path {chosen!r} is not available for {self.fmt!r} experts on {self.device.type}; "
                             f"available: {', '.join(self.paths)}")
        if chosen == "fused":
            from kernels.fused_moe import fused_moe

            return fused_moe(x.contiguous(), self.w13, self.w2, topk_weights, topk_ids, **self.fused_args).float()
        layout = sort_by_expert(topk_ids, self.num_experts, topk_weights)
        # the most slots an expert holds: at most one a token, so counted only where that bound is past the C call's
        rows = tokens if tokens <= self.c_rows or not self.c_rows else int(layout.offsets.diff().max())
        if path is None and rows <= self.c_rows:
            chosen = "grouped"  # a prompt whose routing keeps every expert within the C call's rows
        xs = x[layout.token_index]  # [T*k, H] tokens gathered in expert order
        ys = self._grouped(xs, layout.offsets, rows) if chosen == "grouped" else self._loop(xs, layout.offsets)
        out = torch.zeros(x.shape[0], self.hidden_size, dtype=torch.float32, device=x.device)  # [T, H]
        return out.index_add_(0, layout.token_index, ys.float().mul_(layout.slot_weight[:, None]))

    def _grouped(self, xs: torch.Tensor, offsets: torch.Tensor, rows: int) -> torch.Tensor:
        """Unweighted expert outputs [T*k, H] of the sorted slots: one C call with torch's threads handed over to it
        where no expert holds more than `c_rows` of them (`rows`: the most one holds, or a bound), else two grouped
        GEMMs."""
        if self.int4 is not None:
            with torch_single_threaded():
                return cpu_moe_experts.moe_experts_int4(xs.to(torch.bfloat16), self.int4, offsets,
                                                        round_once=xs.dtype != torch.bfloat16)
        dtype = self.w13.dtype
        if rows <= self.c_rows:
            with torch_single_threaded():
                return cpu_moe_experts.moe_experts(xs.to(dtype), self.w13, self.w2, offsets)
        offs = offsets[1:].to(torch.int32)  # [E] cumulative slot counts
        h = torch._grouped_mm(xs.to(dtype), self.w13.transpose(1, 2), offs=offs)  # [T*k, 2I]
        return torch._grouped_mm(swiglu(h), self.w2.transpose(1, 2), offs=offs)  # [T*k, H]

    def _loop(self, xs: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Unweighted expert outputs [T*k, H] of the sorted slots, one GEMM pair per hit expert (each `Linear`
        takes the C GEMV up to its row limit, an `Int4Linear` the C INT4 GEMV at any). Where every hit expert's
        rows run a C kernel, torch is held at one thread meanwhile, as a decode step holds it
        (`kernels/cpu_threads.py`), so its helpers own the cores."""
        if self.w13 is not None:
            xs = xs.to(self.w13.dtype)
        ys = xs.new_empty(xs.shape[0], self.hidden_size)  # [T*k, H]
        bounds = offsets.tolist()
        runs = [(e, bounds[e], bounds[e + 1]) for e in range(self.num_experts) if bounds[e + 1] > bounds[e]]
        first = self.ops[0][0]
        takes = getattr(first, "takes_gemv", None)  # None: the C INT4 GEMV takes every row count
        gemv_only = getattr(first, "gemv", False) and (takes is None
                                                       or all(takes(end - start) for _, start, end in runs))
        with torch_single_threaded() if gemv_only else contextlib.nullcontext():
            for e, start, end in runs:
                gate_up, down = self.ops[e]
                ys[start:end] = down(swiglu(gate_up(xs[start:end])))
        return ys
