"""Batched token sampling with per-request parameters.

Each row of the logits belongs to one request with its own temperature, top-k, top-p and
(optional) seed. Greedy rows take the argmax (on the CPU the C kernel of
`kernels/cpu_argmax.py`, torch's answer). Sampled rows invert their CDF: the softmax's
running sum in float64, one uniform u per row, the token the first whose running sum
exceeds u times the total (`searchsorted`), so a token of probability p is drawn with
probability p (to float64 rounding) and one of probability 0 (cut by top-k, top-p or a
grammar) never. A seeded request draws its u from its own `torch.Generator` (one draw
per token): the same seed gives the same tokens for the same logits whatever else is in
the batch. (The exponential race it replaced, argmax p_i / E_i with E_i ~ Exp(1), drew a
whole row of noise: torch's CPU `exponential_` took 47-49 ms for 32 rows of 49,152 on a
2-core AMD EPYC VM, half a c = 32 decode step; the inverse CDF takes ~3 ms.) Penalties
(`backend/penalties.py`) come first, on the raw logits, and read only the row's own
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
    if min(top_p) >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly before each token
    remove = before > torch.tensor(top_p).unsqueeze(1)  # the top token always stays (before = 0)
    remove = remove.scatter(1, order, remove)
    return logits.masked_fill(remove, float("-inf"))


def _inverse_cdf(probs: torch.Tensor, params: Seq[SamplingParams],
                 generators: Seq[torch.Generator | None]) -> torch.Tensor:
    """One token per row of probs [B, vocab] drawn by inverting its CDF (module docstring); a row with a
    generator (and not greedy) draws its uniform from it, the others from torch's default generator."""
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    u = torch.rand(probs.shape[0], dtype=torch.float64)
    for row, gen in enumerate(generators):
        if gen is not None and not params[row].greedy:
            u[row] = torch.rand((), generator=gen, dtype=torch.float64)
    target = (u.to(cdf.device) * cdf[:, -1]).unsqueeze(1)
    idx = torch.searchsorted(cdf, target, right=True).squeeze(1)
    past = idx >= probs.shape[1]  # u * total rounded up to the total (u within 2^-53 of 1): the last
    if past.any():                # token with any probability
        last = probs.shape[1] - 1 - (probs.flip(-1) > 0).int().argmax(dim=-1)
        idx = torch.where(past, last, idx)
    return idx


def sample(logits: torch.Tensor, params: Seq[SamplingParams], generators: Seq[torch.Generator | None],
           prompt_ids: Seq[Seq[int]] = (), output_ids: Seq[Seq[int]] = (),
           masks: Seq[torch.Tensor | None] = ()) -> list[int]:
    """One token id per row of logits [B, vocab] (float32, or the LM head's bfloat16: a batch of plain
    greedy rows takes the argmax of it as it is, the same answer as of its float32 copy; any other
    batch is widened to float32 first). `prompt_ids` / `output_ids` (each row's tokens so far) are
    read only when a row asks for a penalty; `masks` (a row's grammar bitmask or None) only when some
    row has one."""
    penalties, masked = needs_penalties(params), any(m is not None for m in masks)
    if masked and not penalties and all(p.greedy for p in params):
        greedy = argmax_rows(logits, mask_words(masks))  # the masked argmax without a masked copy
        if greedy is not None:
            return greedy.tolist()
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
    x = _apply_top_p(x, [p.top_p for p in params])
    sampled = _inverse_cdf(x.softmax(dim=-1), params, generators)
    is_greedy = torch.tensor([p.greedy for p in params])
    return torch.where(is_greedy, greedy, sampled).tolist()
