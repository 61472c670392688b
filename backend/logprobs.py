"""Log-probabilities of chosen tokens and their top alternatives, from a step's logits.

They are the model's own distribution: `log_softmax` of the raw logits row, before
temperature, top-k/top-p and penalties (what scoring clients compare across
engines). Row i of the logits is the distribution of the token after position i, so
a prompt's scores come from logits rows of its prefill positions (every position but
the last, whose row samples the first generated token): the same paged forward pass
that generation runs, chunk by chunk (`ModelRunner.prepare`). Only rows of requests
that ask pay for the `log_softmax` and `topk`.
"""

from __future__ import annotations

import torch

from backend.protocol import Logprobs

__all__ = ["logprobs_of"]


def logprobs_of(logits: torch.Tensor, targets: torch.Tensor, top_n: int) -> Logprobs:
    """Logprobs of `targets` [R] under logits [R, vocab] (float32), with `top_n` alternatives each."""
    lp = logits.float().log_softmax(dim=-1)  # [R, vocab]
    token = lp.gather(1, targets.view(-1, 1).to(torch.int64)).squeeze(1)  # [R]
    if top_n == 0:
        return Logprobs(token.tolist())
    values, ids = lp.topk(top_n, dim=-1)  # [R, top_n], descending
    return Logprobs(token.tolist(), ids.tolist(), values.tolist())
