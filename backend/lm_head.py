"""An 8-bit copy of the LM head for calls of few rows (`EngineConfig.lm_head_weights = "int8"`).

Why: a decode step at one or two requests reads the LM head once a step, a vocab x hidden GEMV bound by
memory. SmolLM2's is 49,152 x 576 bfloat16, 56.6 MB: on a 2-core Zen 4 VM (`bench token-profile`, c = 1) 1.6-1.8
ms of a 4.4-5.3 ms step with INT4 decode weights, a third of it, and 1.9 of 9.8 ms with bfloat16 ones. Read
at one byte a weight it takes half the bytes.

Format: symmetric, one scale a row: s = max |w| / 127 rounded to bfloat16, q = round(w / s) clamped to
-127..127 (the clamp holds a row's largest weight where rounding made s smaller), W8[n, k] = s[n] q[n, k].
On SmolLM2 over 8 x 1,024 held-out Brown tokens against the bfloat16 head (BENCHMARKS.md): perplexity 1.0011x
[0.9998, 1.0024], mean KL 0.0018 (INT4 g32 RTN decode weights read 0.0021 to bf16 in `bench weights`); 7-bit
codes 1.0027x, INT4 g32 1.0547x, so the head stays at 8 bits.

No kernel of its own: with u = q + 128 in 1..255 and its nibbles h, l (u = 16 h + l),

    W8[n, k] = s (16 h + l - 128) = 16 s (h - 8) + (s (l - 8) + 8 s),

the sum of two INT4 weights in `weight_formats`' form W = (code - 8) scale + zero: codes h with scale 16 s and
zero 0, codes l with scale s and zero 8 s (every one exact in bfloat16: s times a power of two). The INT4 GEMV
(`kernels/cpu_gemv_int4.py`) runs them as one weight of 2K columns [H | L] against [x | x]: one call, its
products exact and sums float32, one bfloat16 rounding of y. It reads 1 byte a weight, plus a bfloat16 scale and
zero per row and group of each half (groups of up to 128 columns: ~0.06 byte a weight).

Rows: that kernel does twice a true 8-bit kernel's work a weight (two nibbles), so it wins only while a call is
bound by memory. On the Zen 4 VM against the bfloat16 head (its own C GEMV): 0.68x the time at 1 and 2 rows,
0.99x at 4, 1.36x at 8; whole decode steps of SmolLM2, one engine alternating the two heads step by step, took
0.87x / 0.86x / 0.96x / 1.04x the time at c = 1 / 2 / 4 / 8 with INT4 g32 decode weights and 0.93x / 0.93x /
0.97x / 1.03x with bfloat16 ones. So a call of at most `max_rows` rows runs the 8-bit copy and a larger one the
dense head, which is kept (a model with tied embeddings holds it anyway: its embedding table). `max_rows` is
measured once at load (`crossover`: the largest of 1, 2, 4, 8 rows up to which the copy was the faster at every
count; 4 on that VM; `EDGESERVE_INT8_HEAD_ROWS=N` sets it), 0 where it never is, and then the copy is dropped.
A step's logits thus come from the 8-bit head or the dense one by its number of logits rows (its decode rows and
completed prompts): within the 8-bit rounding above of each other. A first kernel of its own (codes to bfloat16
pairs by sign extension and conversion, then `vdpbf16ps`, two chains a row) ran slower than the two planes: 1.34
against 1.15 ms at one row, 1.70 against 1.61 at four (a throwaway build); the planes already read ~0.6x the
bfloat16 head's time where the bytes alone would allow ~0.53x, so it was dropped.

CPU only, where the INT4 C kernel builds and the hidden size is a multiple of 8; elsewhere `int8_head` keeps
the dense head and says why in the log.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

__all__ = ["Int8Head", "int8_head", "quantize_rows_int8", "crossover", "PROBE_ROWS"]

log = logging.getLogger(__name__)

PROBE_ROWS = (1, 2, 4, 8)  # the row counts `crossover` times


def quantize_rows_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q int8 [N, K] in -127..127, s bfloat16 [N]): w ~ s q per row (module docstring)."""
    wf = w.float()
    s = (wf.abs().amax(dim=1) / 127.0).to(torch.bfloat16)
    safe = torch.where(s.float() > 0, s.float(), torch.ones_like(s, dtype=torch.float32))
    q = torch.round(wf / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, s


def _plane_group(k: int) -> int:
    """The largest INT4 group (128 .. 8 columns) that divides K, so neither half's groups cross the other's."""
    for g in (128, 64, 32, 16, 8):
        if k % g == 0:
            return g
    raise ValueError(f"the LM head's 8-bit copy needs a hidden size that is a multiple of 8, not {k}")


class Int8Head:
    """The LM head as a `LinearOp` (y = x @ W.T, [T, vocab] in x's dtype): calls of at most `max_rows` rows on
    the 8-bit copy, the rest on `dense` (module docstring)."""

    def __init__(self, dense: Any, max_rows: int | None = None) -> None:
        """`dense`: the head as loaded (a `backend.linear.Linear` on the CPU, weight [N, K] with K % 8 == 0).
        `max_rows`: None measures it (`crossover`, or `EDGESERVE_INT8_HEAD_ROWS`)."""
        from kernels.cpu_gemv_int4 import pack

        self.dense = dense
        self.weight = dense.weight  # the dense weight: what the model's memory accounting and dtype checks read
        self.out_features = dense.out_features
        self.nbytes = dense.nbytes  # the head's weights as a model of this size holds them (for per-token FLOPs)
        w = dense.weight
        n, k = w.shape
        g = _plane_group(k)
        q, row_scales = quantize_rows_int8(w)
        u = (q.to(torch.int16) + 128).to(torch.uint8)  # 1..255
        del q
        groups = k // g
        s = row_scales.float()[:, None].expand(n, groups)
        codes = torch.cat([u >> 4, u & 15], dim=1)  # [N, 2K] uint8: H | L
        scales = torch.cat([16 * s, s], dim=1).to(torch.bfloat16)
        zeros = torch.cat([torch.zeros_like(s), 8 * s], dim=1).to(torch.bfloat16)
        self.panels = pack(codes, scales, zeros, g)
        self.max_rows = max_rows if max_rows is not None else _forced_rows()
        if self.max_rows is None:
            self.max_rows = crossover(self)
        if self.max_rows == 0:
            self.panels = None  # never faster here: hold nothing more

    @property
    def gemv(self) -> bool:
        return getattr(self.dense, "gemv", False)

    @property
    def gemv_rows(self) -> int:
        return getattr(self.dense, "gemv_rows", 0)

    @property
    def pack_bytes(self) -> int:
        """Bytes held beside the dense head's: its own packs and the 8-bit copy (panels, scales and zeros)."""
        return getattr(self.dense, "pack_bytes", 0) + (self.panels.nbytes if self.panels is not None else 0)

    def read_bytes(self, rows: int) -> int:
        """Weight bytes a call of `rows` rows reads: the 8-bit copy's, or the dense head's."""
        return self.panels.nbytes if self.panels is not None and rows <= self.max_rows else self.nbytes

    def int8(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] @ (s q).T on the 8-bit copy, in x's dtype (any M; `__call__` picks by rows)."""
        from kernels.cpu_gemv_int4 import gemv_int4

        xb = x.to(torch.bfloat16)
        return gemv_int4(torch.cat([xb, xb], dim=1), self.panels).to(x.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None and x.shape[0] <= self.max_rows:
            return self.int8(x)
        return self.dense(x)


def _forced_rows() -> int | None:
    value = os.environ.get("EDGESERVE_INT8_HEAD_ROWS")
    return None if value is None else max(0, int(value))


def crossover(head: Int8Head, reps: int = 3) -> int:
    """The largest of `PROBE_ROWS` up to which the 8-bit copy took less time than the dense head at every
    count (0: at none): each count's fastest of `reps` interleaved calls on fresh random rows, as a step
    calls them."""
    k = head.weight.shape[1]
    best = 0
    for m in PROBE_ROWS:
        x = torch.randn(m, k).to(head.weight.dtype)
        times = {"int8": float("inf"), "dense": float("inf")}
        calls = {"int8": head.int8, "dense": head.dense}
        for call in calls.values():  # warm
            call(x)
        for _ in range(reps):
            for name, call in calls.items():
                t = time.perf_counter()
                call(x)
                times[name] = min(times[name], time.perf_counter() - t)
        log.debug("8-bit LM head at %d rows: %.3f ms against the dense head's %.3f", m, times["int8"] * 1e3,
                  times["dense"] * 1e3)
        if times["int8"] >= times["dense"]:
            break
        best = m
    return best


def int8_head(dense: Any, device: str = "cpu") -> Any:
    """`Int8Head(dense)` where it can run, else `dense` as it is (the reason in the log)."""
    from kernels import cpu_gemv_int4

    weight = getattr(dense, "weight", None)
    why = None
    if device != "cpu" or weight is None or weight.device.type != "cpu":
        why = "it runs on the CPU only"
    elif weight.shape[1] % 8:
        why = f"the hidden size {weight.shape[1]} is not a multiple of 8"
    elif not cpu_gemv_int4.available():
        why = f"the INT4 C kernel does not build here ({cpu_gemv_int4.build_error()})"
    if why:
        log.warning("--lm-head-weights int8: the LM head stays dense: %s", why)
        return dense
    head = Int8Head(dense)
    log.info("LM head: 8-bit copy for calls of up to %d rows (%.1f MB beside the dense head's %.1f MB)",
             head.max_rows, (head.panels.nbytes if head.panels is not None else 0) / 1e6, head.nbytes / 1e6)
    return head
