"""Token ids → the text a client sees: incremental detokenisation plus stop-string trimming.

The worker stops generating when the text completes a stop string, but the
tokens that spelled it have already been streamed to us; the client must not
see the stop string (OpenAI semantics). So text that could still turn out to be
the start of a stop string is held back: at most `len(longest stop) - 1`
characters. When a stop string appears, everything before it is released and
the rest is dropped. Without stop strings nothing is held back beyond what the
detokeniser holds for incomplete characters.

Special tokens are dropped from the text, except `keep_special_ids`: the markers the
request's tool-call or reasoning parser reads (Kimi's `<|tool_calls_section_begin|>`,
GLM's `<arg_key>`, `<think>` where it is a special token), which the parsers take out
again, so no control token ever reaches `content`.

A response that is not streamed needs no text until the end: with `incremental=False`
`push` only keeps the ids and `finish` decodes them once, after the same left context
of prompt ids the incremental detokeniser uses (two decodes per request instead of two
per token). Where the tokenizer's decoding of that context is not a prefix of its
decoding with the output (a decoder that rewrites across the boundary), it falls back
to the incremental path, so both modes give the same text.
"""

from __future__ import annotations

from collections.abc import Sequence

from backend.tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = ["TextStream"]


class TextStream:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), stop: Sequence[str] = (),
                 keep_special_ids: frozenset[int] = frozenset(), incremental: bool = True) -> None:
        self._tokenizer, self._keep = tokenizer, keep_special_ids
        self._context = list(prompt_ids[max(0, len(prompt_ids) - IncrementalDetokenizer.PROMPT_CONTEXT):])
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids, keep_special_ids=keep_special_ids) \
            if incremental else None
        self._ids: list[int] = []  # not incremental: every id, decoded at `finish`
        self._stops = [s for s in stop if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._pending = ""
        self.stopped = False  # a stop string was seen; later text is dropped

    def push(self, token_ids: Sequence[int]) -> str:
        """Text released by these ids (maybe ""; always "" when not incremental)."""
        if self.stopped:
            return ""
        if self._detok is None:
            self._ids += token_ids
            return ""
        for t in token_ids:
            self._pending += self._detok.push(t)
        return self._release(final=False)

    def finish(self) -> str:
        """End of stream: everything still held that is not part of a stop string."""
        if self.stopped:
            return ""
        self._pending += self._detok.flush() if self._detok is not None else self._whole_text()
        return self._release(final=True)

    def _whole_text(self) -> str:
        head = self._tokenizer.decode(self._context, keep_special_ids=self._keep)
        text = self._tokenizer.decode(self._context + self._ids, keep_special_ids=self._keep)
        if text.startswith(head):
            return text[len(head):]
        detok = IncrementalDetokenizer(self._tokenizer, self._context, keep_special_ids=self._keep)
        return "".join(detok.push(t) for t in self._ids) + detok.flush()

    def _release(self, final: bool) -> str:
        cut = min((i for i in (self._pending.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            out, self._pending = self._pending[:cut], ""
            return out
        keep = 0 if final else self._hold
        split = max(0, len(self._pending) - keep)
        out, self._pending = self._pending[:split], self._pending[split:]
        return out
