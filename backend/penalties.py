"""Repetition penalties, applied row by row to the batched logits before temperature.

Two definitions, as the APIs we mirror state them:

- OpenAI (`frequency_penalty`, `presence_penalty`, each in [-2, 2]) over the tokens
  generated so far, with c[t] the number of times token t was generated:
      logit[t] -= frequency_penalty * c[t] + presence_penalty * (c[t] > 0)
- Hugging Face / Workers AI (`repetition_penalty` > 0, 1 is neutral) over every token
  seen in the prompt or the output: a positive logit is divided by it, a negative one
  multiplied, so a penalty above 1 always makes a seen token less likely.

Only rows that ask for a penalty are touched, and a batch where no row does costs
nothing (`needs_penalties` is one pass over the parameters). The result depends only on
the row's logits and its own history, so a seeded request samples the same tokens
alone or in a batch (`backend/sampler.py`).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from backend.sampling_params import SamplingParams

__all__ = ["needs_penalties", "apply_penalties", "apply_penalties_ref"]


def needs_penalties(params: Seq[SamplingParams]) -> bool:
    """Whether any row asks for a penalty (else `apply_penalties` is skipped entirely)."""
    return any(p.has_penalties for p in params)


def apply_penalties(logits: torch.Tensor, params: Seq[SamplingParams], prompt_ids: Seq[Seq[int]],
                    output_ids: Seq[Seq[int]]) -> torch.Tensor:
    """Penalised copy of logits [B, vocab] (float32); rows without penalties are unchanged."""
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    if not rows:
        return logits
    out = logits.clone()
    vocab = logits.shape[-1]
    for i in rows:
        p = params[i]
        row = out[i]  # [vocab], a view
        if p.frequency_penalty or p.presence_penalty:
            counts = torch.bincount(torch.tensor(output_ids[i], dtype=torch.int64), minlength=vocab).to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted({*prompt_ids[i], *output_ids[i]}), dtype=torch.int64)
            x = row[seen]
            row[seen] = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
    return out


def apply_penalties_ref(logits: list[float], p: SamplingParams, prompt_ids: Seq[int],
                        output_ids: Seq[int]) -> list[float]:
    """Plain-Python reference for one row: the definitions above, token by token."""
    out = list(logits)
    for t in set(output_ids):
        c = list(output_ids).count(t)
        out[t] -= p.frequency_penalty * c + p.presence_penalty * (1.0 if c > 0 else 0.0)
    if p.repetition_penalty != 1.0:
        for t in set(prompt_ids) | set(output_ids):
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    return out
