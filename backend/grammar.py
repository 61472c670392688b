"""Grammar-constrained decoding (structured output) with llguidance.

A request with `SamplingParams.grammar` (`GrammarSpec`: `json_object`, `json_schema`
with the schema as a JSON string, or `lark` with a Lark grammar in llguidance's dialect,
which the gateway writes for `tool_choice` "required" / named functions,
`gateway/tool_grammar.py`) decodes under a grammar: at every step the sampler
keeps only the tokens the grammar allows next, so the output always parses, and under
a schema always validates, once it finishes (a `max_tokens` cut ends it with
`finish_reason` "length", a prefix of a valid document).

Why llguidance (not xgrammar): it is a self-contained Rust library with no Python
dependencies, built from the `tokenizer.json` the worker already loads (through the
`tokenizers` library, `Tokenizer.backend_json`), while xgrammar needs `transformers` at
runtime, which the serving install leaves out. Its JSON-schema compiler is lazy (a
schema compiles in well under a millisecond; the lexer states are built as decoding
reaches them) and a mask costs tens of microseconds.

The pieces:

- `grammar_of(spec)` (`grammar_text.py`, importable without torch) turns a spec into
  llguidance's grammar text and checks it (no tokenizer needed: the gateway calls it to
  answer an invalid schema with a 400). JSON is compact (`whitespace_flexible` off): no whitespace between tokens, so a model
  cannot spend its tokens on blank space.
- `GrammarCompiler` holds the `LLTokenizer` (built once per worker, ~0.3 s) and one
  compiled matcher per distinct spec (keyed by its hash, bounded, least recently used
  out); a request gets a `deep_copy` of it (microseconds).
- `GrammarState` is one request's matcher plus its next-token bitmask: `advance(token)`
  consumes a sampled token and computes the mask for the next step right away, on the
  engine thread after sampling and before the next forward (the engine counts the time in
  its `grammar_advance_s` stat; tens of microseconds against a step of milliseconds).
- `apply_masks` sets the logits of disallowed tokens to -inf, only in rows that have a
  mask; a batch with none is not touched. `mask_words` stacks a batch's masks for the C
  kernels of `kernels/cpu_argmax.py`: a greedy batch takes its masked argmax straight
  from the logits, and `apply_masks` writes its -inf with them where they build
  (torch's bit unpacking took 11-13 ms for 32 rows of 49,152 on a 2-core VM, ~10% of a
  decode step; the kernels a fraction of a millisecond).

End of sequence: llguidance puts the EOS ids in the mask only where the grammar
accepts, so EOS cannot cut a document short; a grammar that can take no further token
(`done`) ends the request with "stop" without another step.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence as Seq

import llguidance
import torch

from backend.errors import InvalidSamplingParams
from backend.grammar_text import JSON_OBJECT_SCHEMA, grammar_of
from backend.sampling_params import GrammarSpec
from kernels.cpu_argmax import mask_fill_rows

__all__ = ["grammar_of", "GrammarCompiler", "GrammarState", "apply_masks", "mask_words", "allowed_tokens",
           "JSON_OBJECT_SCHEMA"]

_BIT = torch.arange(32, dtype=torch.int32)  # bit i of a mask word is token 32 * word + i


class GrammarState:
    """One request's grammar: its matcher and the bitmask of the tokens allowed next."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.mask = torch.empty((vocab_size + 31) // 32, dtype=torch.int32)  # [words]; bit set: token allowed
        self._fill()

    @property
    def done(self) -> bool:
        """The grammar is complete and allows no token but EOS."""
        return self.matcher.is_stopped()

    def advance(self, token: int) -> None:
        """Consume a sampled token (always one the mask allowed) and compute the next mask.
        Raises InvalidSamplingParams if the matcher refuses it (a bug or an unforced token)."""
        if not self.matcher.consume_token(token):
            raise InvalidSamplingParams(f"grammar refused token {token}: {self.matcher.get_error()}",
                                        field="response_format")
        self._fill()

    def _fill(self) -> None:
        self.matcher.unsafe_compute_mask_ptr(self.mask.data_ptr(), self.mask.numel() * 4)
        if self.matcher.is_error():
            raise InvalidSamplingParams(f"grammar failed: {self.matcher.get_error()}", field="response_format")


class GrammarCompiler:
    """The worker's llguidance tokenizer and its cache of compiled grammars (one per distinct spec)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Iterable[int],
                 cache_size: int = 256) -> None:
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                eos_token=sorted(eos_token_ids) or None)
        self._cache: OrderedDict[bytes, llguidance.LLMatcher] = OrderedDict()
        self._cache_size = cache_size
        self.compile_s: list[float] = []  # seconds per compilation (cache misses)

    def state(self, spec: GrammarSpec) -> GrammarState:
        """A fresh `GrammarState` for one request, its first mask computed."""
        key = hashlib.sha256(f"{spec.kind}\0{spec.schema}".encode()).digest()
        matcher = self._cache.get(key)
        if matcher is None:
            t0 = time.perf_counter()
            matcher = llguidance.LLMatcher(self.tokenizer, grammar_of(spec), log_level=0)
            if matcher.is_error():  # e.g. a special token this tokenizer does not have
                field = "tool_choice" if spec.kind == "lark" else "response_format"
                raise InvalidSamplingParams(f"invalid grammar: {matcher.get_error()}", field=field)
            self.compile_s.append(time.perf_counter() - t0)
            self._cache[key] = matcher
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return GrammarState(matcher.deep_copy(), self.vocab_size)


def mask_words(masks: Seq[torch.Tensor | None]) -> torch.Tensor:
    """A batch's masks as one int32 [B, words] tensor, a row without a mask all ones (every token allowed)."""
    width = next(m.shape[0] for m in masks if m is not None)
    return torch.stack([m if m is not None else torch.full((width,), -1, dtype=torch.int32) for m in masks])


def apply_masks(logits: torch.Tensor, masks: Seq[torch.Tensor | None], in_place: bool = False) -> torch.Tensor:
    """Logits [B, vocab] with every token a row's mask forbids at -inf (a copy when any row has a
    mask, unless `in_place`; the same tensor when none has)."""
    rows = [i for i, m in enumerate(masks) if m is not None]
    if not rows:
        return logits
    out = logits if in_place else logits.clone(memory_format=torch.contiguous_format)
    if mask_fill_rows(out, mask_words(masks)):  # the C kernel, where it runs this case
        return out
    words = torch.stack([masks[i] for i in rows])  # [R, words] int32
    allowed = ((words.unsqueeze(-1) >> _BIT) & 1).flatten(1)[:, : logits.shape[1]].bool()  # [R, vocab]
    idx = torch.tensor(rows)
    out[idx] = out[idx].masked_fill(~allowed, float("-inf"))
    return out


def allowed_tokens(mask: torch.Tensor, vocab_size: int) -> list[int]:
    """The token ids a [words] bitmask allows (tests, debugging)."""
    bits = ((mask.unsqueeze(-1) >> _BIT) & 1).flatten()[:vocab_size]
    return bits.nonzero().flatten().tolist()
