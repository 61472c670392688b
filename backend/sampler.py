"""Batched token sampling with per-request parameters.

Each row of the logits belongs to one request with its own temperature, top-k, top-p and
(optional) seed. Greedy rows take the argmax (on the CPU the C kernel of
`kernels/cpu_argmax.py`, torch's answer). Sampled rows invert their CDF with one uniform u
per row: the token is the first whose running sum of the softmax exceeds u times the
total, so a token of probability p is drawn with probability p (to rounding) and one of
probability 0 (cut by top-k, top-p or a grammar) never. On the CPU the C kernel of
`kernels/cpu_sample.py` does it in three passes over the row, from the logits as they are
for a row without penalties (temperature, grammar, top-k and top-p applied inside), else
from the float32 row torch prepared; elsewhere torch's softmax, float64 running sum and
`searchsorted`. A seeded request draws its u from its own `torch.Generator` (one draw
per token): the same seed gives the same tokens for the same logits whatever else is in
the batch. (The exponential race it replaced, argmax p_i / E_i with E_i ~ Exp(1), drew a
whole row of noise: torch's CPU `exponential_` took 47-49 ms for 32 rows of 49,152 on a
2-core AMD EPYC VM, half a c = 32 decode step; torch's inverse CDF ~20 ms, the kernel ~3.)
Penalties (`backend/penalties.py`) come first, on the raw logits, and read only the row's own
history, so they keep that; a batch where no row asks for one skips them (no extra work
for plain requests). A grammar row's mask (`backend/grammar.py`) comes after the
penalties: disallowed tokens get -inf before greedy or sampled choice; rows without one,
and batches without any, are untouched. A greedy batch without penalties takes its
masked argmax from the logits as they are (`kernels/cpu_argmax.py`), no masked copy.

Whether a request's logits are the same in another batch is the model's part
(`backend/model.py`), and what holds is this:

- Weights, always: every row runs on its own phase's weights in every step, decode
  rows on the decode format and prompt rows on the prefill format, whatever shares
  the step.
- Beside prompts, with distinct prefill and decode formats: a decode row never shares
  a GEMM (the LM head included) with a prompt row, and every other op works row by
  row, so its logits are bit-identical to those of a step with the same decode rows
  and no prompt chunk. A seeded request decoded alone and one decoded while other
  prompts prefill in its steps give the same tokens.
- Float batch-invariance is a separate property, not promised: a GEMM's rounding
  can change with its row count (MKL's float32 GEMM differs in the last bits between
  1 and 2 rows on this CPU class), and decode attention pads keys to the step's
  longest context. So with one format for both phases (prompt and decode rows share
  each GEMM), or beside other decoding requests, the logits agree with the alone run
  in all but the last bits, and a token can change only where two candidates tie to
  within that rounding.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from backend.grammar import apply_masks, mask_words
from backend.penalties import apply_penalties, needs_penalties
from backend.sampling_params import SamplingParams
from kernels import cpu_sample
from kernels.cpu_argmax import argmax_rows

__all__ = ["sample"]


def _apply_top_k(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    vocab = logits.shape[-1]
    ks = [k if 0 < k < vocab else vocab for k in top_k]
    if min(ks) == vocab:
        return logits
    kmax = max(k for k in ks if k < vocab)
    values = logits.topk(kmax, dim=-1).values  # [B, kmax], descending
    idx = torch.tensor([min(k, kmax) - 1 for k in ks]).unsqueeze(1)
    threshold = values.gather(1, idx)
    threshold[torch.tensor([k == vocab for k in ks])] = float("-inf")
    return logits.masked_fill(logits < threshold, float("-inf"))


def _apply_top_p(logits: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """The smallest set of a row's most probable tokens whose mass reaches its top_p, the rest at -inf; a
    token tied with the last one kept stays too (as top-k keeps ties). The cut is a value per row, so the
    rows are masked by comparison, with no scatter of the sorted order back (the sort itself stays: ~80 ms
    for 32 rows of 49,152 on a 2-core VM)."""
    if min(top_p) >= 1.0:
        return logits
    sorted_logits = logits.sort(dim=-1, descending=True).values
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly before each token: non-decreasing
    kept = (before <= torch.tensor(top_p).unsqueeze(1)).sum(dim=-1, keepdim=True).clamp_(min=1)  # the top one
    cut = sorted_logits.gather(1, kept - 1)  # the last kept token's logit
    return logits.masked_fill(logits < cut, float("-inf"))


def _uniforms(params: Seq[SamplingParams], generators: Seq[torch.Generator | None]) -> torch.Tensor:
    """One uniform in [0, 1) per row (float64 [B]): a sampled row with a generator draws it from that, the
    others from torch's default generator."""
    u = torch.rand(len(params), dtype=torch.float64)
    for row, gen in enumerate(generators):
        if gen is not None and not params[row].greedy:
            u[row] = torch.rand((), generator=gen, dtype=torch.float64)
    return u


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of probs [B, vocab] drawn by inverting its CDF with the row's uniform (module
    docstring): torch's ops, where the C kernel does not run."""
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    target = (u.to(cdf.device) * cdf[:, -1]).unsqueeze(1)
    idx = torch.searchsorted(cdf, target, right=True).squeeze(1)
    past = idx >= probs.shape[1]  # u * total rounded up to the total (u within 2^-53 of 1): the last
    if past.any():                # token with any probability
        last = probs.shape[1] - 1 - (probs.flip(-1) > 0).int().argmax(dim=-1)
        idx = torch.where(past, last, idx)
    return idx


def _plain(p: SamplingParams) -> bool:
    """A sampled row without penalties: the C kernel draws it from the logits as they are (temperature,
    grammar, top-k and top-p inside)."""
    return not p.greedy and not p.has_penalties


def sample(logits: torch.Tensor, params: Seq[SamplingParams], generators: Seq[torch.Generator | None],
           prompt_ids: Seq[Seq[int]] = (), output_ids: Seq[Seq[int]] = (),
           masks: Seq[torch.Tensor | None] = ()) -> list[int]:
    """One token id per row of logits [B, vocab] (float32, or the LM head's bfloat16: greedy rows take
    the argmax of it as it is, the same answer as of its float32 copy; rows with a penalty, top-k or
    top-p are widened to float32 first). `prompt_ids` / `output_ids` (each row's tokens so far) are
    read only when a row asks for a penalty; `masks` (a row's grammar bitmask or None) only when some
    row has one.

    Each row's token depends on its own logits, parameters and uniform only: sampled rows without
    penalties (`_plain`) are drawn by the C kernel from the logits as they are, the others through
    torch's preparation, whatever else shares the batch."""
    masked = any(m is not None for m in masks)
    words = mask_words(masks) if masked else None
    if not needs_penalties(params) and all(p.greedy for p in params):
        greedy = argmax_rows(logits, words)  # the C kernel, masked without a masked copy
        if greedy is not None:
            return greedy.tolist()
    if all(p.greedy for p in params) or not cpu_sample.available():
        return _sample_torch(logits, params, _uniforms(params, generators), prompt_ids, output_ids, masks)
    u = _uniforms(params, generators)
    plain = [_plain(p) for p in params]
    tokens = [0] * len(params)
    rows = [i for i, ok in enumerate(plain) if ok]
    if rows:
        sub = rows if len(rows) < len(params) else slice(None)
        inv_t = torch.tensor([1.0 / params[i].temperature for i in rows], dtype=torch.float32)
        top_k = torch.tensor([min(params[i].top_k, logits.shape[1]) for i in rows], dtype=torch.int32)  # >= V: off
        top_p = torch.tensor([params[i].top_p for i in rows], dtype=torch.float32)
        drawn = cpu_sample.sample_rows(logits[sub].contiguous(), inv_t, u[sub].contiguous(),
                                       None if words is None else words[sub].contiguous(),
                                       top_k if top_k.any() else None, top_p if (top_p < 1).any() else None)
        if drawn is None:  # a case the kernel does not take (e.g. a strided or a CUDA tensor)
            return _sample_torch(logits, params, u, prompt_ids, output_ids, masks)
        for i, t in zip(rows, drawn.tolist(), strict=True):
            tokens[i] = t
    rest = [i for i, ok in enumerate(plain) if not ok]
    if rest:
        pick = lambda seq: [seq[i] for i in rest] if seq else seq  # noqa: E731
        for i, t in zip(rest, _sample_torch(logits[rest], pick(params), u[rest], pick(prompt_ids),
                                            pick(output_ids), pick(masks)), strict=True):
            tokens[i] = t
    return tokens


def _sample_torch(logits: torch.Tensor, params: Seq[SamplingParams], u: torch.Tensor, prompt_ids: Seq[Seq[int]],
                  output_ids: Seq[Seq[int]], masks: Seq[torch.Tensor | None]) -> list[int]:
    """`sample` through torch's ops: widen, penalties, grammar masks, then the argmax for greedy rows and,
    for sampled ones, temperature, top-k, top-p and the draw (the C kernel on the prepared float32 rows
    where it runs, else the softmax's inverted CDF in torch)."""
    penalties, masked = needs_penalties(params), any(m is not None for m in masks)
    widened = logits.dtype != torch.float32 and (penalties or masked or not all(p.greedy for p in params))
    if widened:
        logits = logits.float()
    if penalties:
        logits = apply_penalties(logits, params, prompt_ids, output_ids)
    if masked:
        logits = apply_masks(logits, masks, in_place=widened or penalties)  # a copy of ours already
    greedy = argmax_rows(logits)  # the C kernel; torch's argmax where it cannot run
    if greedy is None:
        greedy = logits.argmax(dim=-1)
    if all(p.greedy for p in params):
        return greedy.tolist()
    temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params]).unsqueeze(1)
    x = _apply_top_k(logits / temps, [p.top_k for p in params])
    x = _apply_top_p(x, [p.top_p for p in params]).contiguous()
    sampled = cpu_sample.sample_rows(x, torch.ones(x.shape[0], dtype=torch.float32), u.contiguous())
    if sampled is None:
        sampled = _inverse_cdf(x.softmax(dim=-1), u)
    is_greedy = torch.tensor([p.greedy for p in params])
    return torch.where(is_greedy, greedy.to(sampled.device), sampled).tolist()
