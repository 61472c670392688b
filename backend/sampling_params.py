"""Per-request sampling parameters (a wire struct) and their validation."""

from __future__ import annotations

import msgspec

from backend.errors import InvalidSamplingParams

__all__ = ["SamplingParams", "GrammarSpec", "GRAMMAR_KINDS", "MAX_STOP_STRINGS", "MAX_TOP_LOGPROBS"]

MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20  # alternatives per position, as OpenAI allows
GRAMMAR_KINDS = ("json_object", "json_schema", "lark")


class GrammarSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Structured output the worker enforces (`backend/grammar.py`): `json_object` (any JSON
    object), `json_schema` with `schema` the JSON schema as a string, or `lark` with `schema` a
    Lark grammar in llguidance's dialect (the gateway's tool_choice required/named grammars)."""

    kind: str
    schema: str = ""


class SamplingParams(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """How to pick tokens and when to stop.

    temperature 0 means greedy. top_k 0 and top_p 1.0 disable those filters.
    A seed fixes the sampling noise: the same seed and the same logits give the same
    tokens whatever else is in the batch. The logits are bit-identical whether the
    request decodes alone or beside other prompts' prefill when the prefill and decode
    weight formats differ (the two kinds of rows then run separate GEMMs); otherwise
    (one format, or other requests decoding beside it) they agree up to float rounding
    in the last bits (see `backend/sampler.py`).

    Penalties (`backend/penalties.py`): OpenAI's frequency/presence penalties over the
    generated tokens (0 neutral), Hugging Face's repetition penalty over prompt and
    output (1 neutral). `logprobs` N returns each generated token's log-probability
    and its N most likely alternatives (0: the token's only); `prompt_logprobs` N the
    same for every prompt token after the first, computed on the paged prefill path
    (the prompt is then computed whole, never served from the prefix cache). With
    `prompt_logprobs`, `max_tokens` may be 0: score the prompt, generate nothing.
    Log-probabilities are the model's (raw logits), before temperature and penalties.

    `grammar` constrains decoding to JSON (`backend/grammar.py`); EOS is then allowed only
    where the document is complete, so `ignore_eos` is refused with it. Stop strings and
    stop ids still apply: a match ends the output there, as the client asked, complete or not.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    grammar: GrammarSpec | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0

    def validate(self, vocab_size: int) -> None:
        """Raise InvalidSamplingParams naming the first bad field."""
        def bad(field: str, why: str) -> InvalidSamplingParams:
            return InvalidSamplingParams(f"invalid {field}: {why}", field=field)

        least = 0 if self.prompt_logprobs is not None else 1  # 0: only score the prompt
        if self.max_tokens < least:
            raise bad("max_tokens", f"must be >= {least}, got {self.max_tokens}")
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
        for field in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, field)
            if not -2.0 <= value <= 2.0:  # also refuses NaN
                raise bad(field, f"must be in [-2, 2], got {value}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise bad("repetition_penalty", f"must be in (0, 2], got {self.repetition_penalty}")
        for field in ("logprobs", "prompt_logprobs"):
            value = getattr(self, field)
            if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
                raise bad(field, f"must be in [0, {MAX_TOP_LOGPROBS}], got {value}")
        if self.grammar is not None:
            if self.grammar.kind not in GRAMMAR_KINDS:
                raise bad("response_format", f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}")
            if self.ignore_eos:
                raise bad("ignore_eos", "cannot be combined with a grammar (EOS ends the document)")
