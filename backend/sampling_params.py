"""Per-request sampling parameters (a wire struct) and their validation."""

from __future__ import annotations

import msgspec

from backend.errors import InvalidSamplingParams

__all__ = ["SamplingParams", "MAX_STOP_STRINGS"]

MAX_STOP_STRINGS = 16


class SamplingParams(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """How to pick tokens and when to stop.

    temperature 0 means greedy. top_k 0 and top_p 1.0 disable those filters.
    A seed fixes the sampling noise: the same seed and the same logits give the same
    tokens whatever else is in the batch. The logits are bit-identical whether the
    request decodes alone or beside other prompts' prefill when the prefill and decode
    weight formats differ (the two kinds of rows then run separate GEMMs); otherwise
    (one format, or other requests decoding beside it) they agree up to float rounding
    in the last bits (see `backend/sampler.py`).
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int) -> None:
        """Raise InvalidSamplingParams naming the first bad field."""
        def bad(field: str, why: str) -> InvalidSamplingParams:
            return InvalidSamplingParams(f"invalid {field}: {why}", field=field)

        if self.max_tokens < 1:
            raise bad("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0 or self.temperature != self.temperature:
            raise bad("temperature", f"must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise bad("top_k", f"must be >= 0 (0 disables), got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise bad("seed", "must be in [0, 2^63)")
        if len(self.stop) > MAX_STOP_STRINGS or any(not s for s in self.stop):
            raise bad("stop", f"at most {MAX_STOP_STRINGS} non-empty strings")
        if any(not 0 <= t < vocab_size for t in self.stop_token_ids):
            raise bad("stop_token_ids", f"ids must be in [0, {vocab_size})")
