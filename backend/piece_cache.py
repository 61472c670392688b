"""Token ids of a prompt piece by piece between added tokens, the pieces seen before taken from a cache.

`tokenizers` encodes a text in two stages: it first finds the tokenizer's added tokens in it
(`<|im_start|>`, `<|im_end|>`, ...: leftmost, longest first), then normalises, pre-tokenises and
runs the model on each stretch of text between them on its own. So a text's ids are, in order,
each added token's id and each stretch's ids encoded alone, wherever nothing about a stretch
depends on where it sits in the whole: no added token strips the whitespace beside it
(`lstrip` / `rstrip`), matches only as a whole word (`single_word`) or matches after
normalisation, and no normaliser or pre-tokeniser treats the start of the input apart
(SentencePiece's `Prepend` normaliser, the `Metaspace` pre-tokeniser's prepend scheme).
`PieceCache.for_backend` checks those conditions, then encodes probe texts both ways, and
gives None (encode whole) where anything differs.

A chat prompt is mostly pieces seen before: the system prompt, tool definitions and every
earlier turn of a conversation come back with each new message, so a gateway that encodes the
whole prompt again pays for the whole history on every turn. With the cache a turn pays for its
new message (figures in BENCHMARKS.md, "Prompt pieces"). Pieces are kept per `namespace` (the
gateway passes the tenant: one tenant's prompts never make another's faster, the rule the prefix
cache's tenant salt follows), `max_chars` characters in all, least recently used out, in two
levels so tenants do not crowd each other out: a namespace holds at most `share` of the budget
(past it, its own oldest pieces go), and when the whole is full the oldest pieces of the namespace
used least recently go first. A piece longer than a namespace's share is encoded and not kept.
Thread-safe (prompts are encoded in threads when large).
"""

from __future__ import annotations

import json
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer as _BackendTokenizer

__all__ = ["PieceCache", "MAX_CHARS", "SHARE"]

MAX_CHARS = 8 << 20  # characters of cached pieces, all namespaces together (~50 MB with their ids at worst)
SHARE = 0.25  # of MAX_CHARS, the most one namespace holds (2 M characters: ~500 k tokens of a tenant's chats)
_SHORT = 1024  # characters: misses up to this many in all are encoded holding the GIL (as `Tokenizer` does)
_UNSAFE_STAGES = ("Prepend", "Metaspace")  # normaliser / pre-tokeniser types that treat the input's start apart


class PieceCache:
    """Encodes text with its added tokens matched (as `tokenizers` does with `add_special_tokens=False`),
    piece by piece, caching pieces per namespace."""

    def __init__(self, backend: _BackendTokenizer, max_chars: int = MAX_CHARS, share: float = SHARE) -> None:
        self._backend = backend
        tokens = {i: t for i, t in backend.get_added_tokens_decoder().items() if t.content}
        self._ids = {t.content: i for i, t in tokens.items()}
        # tokenizers matches the added tokens that are not normalised first, then, in the text between them, those
        # that are (on the normalised text: the same text here, `for_backend` takes no normaliser with them)
        self._passes = [_alternation([t.content for t in tokens.values() if t.normalized == normalized])
                        for normalized in (False, True)]
        self._max_chars, self._ns_max_chars = max_chars, int(max_chars * share)
        # namespace -> its pieces, oldest first (ids as 32-bit ints: 4 bytes a token); namespaces oldest first
        self._spaces: OrderedDict[str, OrderedDict[str, array]] = OrderedDict()
        self._ns_chars: dict[str, int] = {}
        self._chars = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0  # pieces, since the start (for tests and benchmarks)

    @classmethod
    def for_backend(cls, backend: _BackendTokenizer, max_chars: int = MAX_CHARS, share: float = SHARE
                    ) -> PieceCache | None:
        """A cache for this tokenizer, or None where encoding piece by piece could differ from encoding whole
        (module doc: the added tokens' options, the pipeline's stages, then probe texts)."""
        tokens = backend.get_added_tokens_decoder().values()
        normalizer, pre_tokenizer = (json.loads(c.__getstate__()) if c is not None else None  # not the vocabulary
                                     for c in (backend.normalizer, backend.pre_tokenizer))
        if any(t.lstrip or t.rstrip or t.single_word or (t.normalized and normalizer) for t in tokens):
            return None
        if _mentions(normalizer, _UNSAFE_STAGES) or _mentions(pre_tokenizer, _UNSAFE_STAGES):
            return None
        cache = cls(backend, max_chars, share)
        specials = [t.content for t in tokens if t.content][:3]
        for probe in _probes(specials):
            if cache._encode_uncached(probe) != backend.encode(probe, add_special_tokens=False).ids:
                return None
        return cache

    def encode(self, text: str, namespace: str = "") -> list[int]:
        """The ids `tokenizers` gives `text` (added tokens matched, no post-processor tokens)."""
        parts = self._split(text)  # text, token, text, ..., token, text
        found: dict[str, Sequence[int]] = {}
        with self._lock:
            space = self._spaces.get(namespace)
            if space is not None:
                self._spaces.move_to_end(namespace)
                for piece in parts[0::2]:
                    if piece and piece not in found:
                        ids = space.get(piece)
                        if ids is not None:
                            space.move_to_end(piece)
                            found[piece] = ids
            self.hits += len(found)
        missing = list(dict.fromkeys(p for p in parts[0::2] if p and p not in found))
        if missing:
            encoded = self._encode_pieces(missing)
            found.update(zip(missing, encoded, strict=True))
            self._keep(namespace, missing, encoded)
        return self._join(parts, found)

    def _join(self, parts: list[str], pieces: dict[str, Sequence[int]]) -> list[int]:
        """The ids of `parts` (text, token, text, ...), each text's from `pieces`."""
        ids: list[int] = []
        for i, part in enumerate(parts):
            if i % 2:
                ids.append(self._ids[part])
            elif part:
                ids.extend(pieces[part])
        return ids

    def _encode_pieces(self, pieces: list[str]) -> list[list[int]]:
        if len(pieces) == 1 and len(pieces[0]) < _SHORT:
            return [self._backend.encode(pieces[0], add_special_tokens=False).ids]
        return [e.ids for e in self._backend.encode_batch(pieces, add_special_tokens=False)]  # releases the GIL

    def _split(self, text: str) -> list[str]:
        parts = [text]
        for alternation in self._passes:
            if alternation is not None:
                parts = [q for i, p in enumerate(parts) for q in ([p] if i % 2 else alternation.split(p))]
        return parts

    def _encode_uncached(self, text: str) -> list[int]:
        parts = self._split(text)
        texts = list(dict.fromkeys(p for p in parts[0::2] if p))
        return self._join(parts, dict(zip(texts, self._encode_pieces(texts), strict=True)) if texts else {})

    def _keep(self, namespace: str, pieces: list[str], encoded: list[list[int]]) -> None:
        with self._lock:
            self.misses += len(pieces)
            space = self._spaces.get(namespace)
            if space is None:
                space = self._spaces[namespace] = OrderedDict()
                self._ns_chars[namespace] = 0
            self._spaces.move_to_end(namespace)
            for piece, ids in zip(pieces, encoded, strict=True):
                if len(piece) > self._ns_max_chars or piece in space:
                    continue
                space[piece] = array("i", ids)
                self._ns_chars[namespace] += len(piece)
                self._chars += len(piece)
            while self._ns_chars[namespace] > self._ns_max_chars:  # past its share: its own oldest go
                self._evict(namespace)
            while self._chars > self._max_chars:  # the whole full: the least recently used namespace's oldest
                self._evict(next(iter(self._spaces)))

    def _evict(self, namespace: str) -> None:
        space = self._spaces[namespace]
        piece, _ = space.popitem(last=False)
        self._ns_chars[namespace] -= len(piece)
        self._chars -= len(piece)
        if not space:
            del self._spaces[namespace], self._ns_chars[namespace]


def _alternation(tokens: list[str]) -> re.Pattern[str] | None:
    """A pattern that splits text at these tokens, keeping them: leftmost match, the longest at a position (the
    alternation tries longer tokens first), as tokenizers' matcher does."""
    if not tokens:
        return None
    return re.compile("(" + "|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)) + ")")


def _mentions(stage: Any, types: tuple[str, ...]) -> bool:
    """Whether a normaliser or pre-tokeniser (tokenizer.json's object, sequences nested) has one of `types`."""
    if isinstance(stage, dict):
        return stage.get("type") in types or any(_mentions(v, types) for v in stage.values())
    if isinstance(stage, list):
        return any(_mentions(v, types) for v in stage)
    return False


def _probes(specials: list[str]) -> list[str]:
    """Texts around added tokens whose pieces a pipeline that sees the whole input could treat differently:
    spaces, newlines, digits and non-ASCII at each edge."""
    a, b, c = (specials + ["", "", ""])[:3]
    return [f"{a}system\nYou are helpful.{b}\n{a}user\n 12 héllo  wörld 👋{b}\n{a}assistant\n",
            f"  leading{a}  both  {b}trailing  ", f"{c}{c}x{a}\n\n{b} {a}",
            "no added tokens at all, 3.14 and  spaces\t"]
