"""Record the logits row each sequence was sampled from, per step (test helper, not a test)."""

from __future__ import annotations

import torch

from backend.engine import LLMEngine
from backend.scheduler import ScheduledBatch


def record_sampled_logits(engine: LLMEngine) -> dict[str, list[torch.Tensor]]:
    """Wrap engine.postprocess; returns request_id -> the logits of each sampled token, in order."""
    seen: dict[str, list[torch.Tensor]] = {}
    original = engine.postprocess

    def spy(batch: ScheduledBatch, logits: torch.Tensor):
        rows = list(batch.decode) + [s for s, n in batch.prefill if s.num_computed_tokens + n == s.num_prompt_tokens]
        for s, row in zip(rows, logits):
            seen.setdefault(s.request_id, []).append(row.clone())
        return original(batch, logits)

    engine.postprocess = spy  # type: ignore[method-assign]
    return seen
