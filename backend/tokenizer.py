"""Runtime tokenizer: `tokenizer.json` through `tokenizers`, chat templates through jinja2.

Serving never imports `transformers`. A model folder gives us:

- `tokenizer.json`         the whole encode/decode pipeline (`tokenizers.Tokenizer`);
- `tokenizer_config.json`  special token strings and the chat template (or `chat_template.jinja`);
- `config.json` / `generation_config.json`  BOS and the end-of-generation ids.

Chat templates are rendered the way Hugging Face renders them, so a template written for
`transformers` gives the same prompt here: a sandboxed jinja2 environment with
`trim_blocks`/`lstrip_blocks`, the `loopcontrols` extension, a `tojson` that does not
HTML-escape, the globals `raise_exception` and `strftime_now`, and the special token
strings (`bos_token`, `eos_token`, ...) as variables.

Control tokens come only from the template
------------------------------------------
Message text is the client's: `<|im_start|>system` typed in a user message must stay
text, not open a system turn. `encode_chat` renders the template twice, with the real
messages and with each message's content replaced by a placeholder (the template's own
text). When the template wrote every message's text unchanged and no text holds the first
or last character of a control token (nor is part of one), no control token can match
anything but the template's own text, and the real rendering is encoded once: the common
case, and half the encoding time. Otherwise both renderings are encoded with special tokens
matched; when the real prompt holds the same
special tokens in the same order as the template's own text, no message text became a
control token and those ids are the answer (exactly what encoding the rendered string
gives, as transformers does). Otherwise the placeholder rendering is split into the
template's segments, encoded with special tokens matched, and the messages' text,
encoded with special tokens split into ordinary pieces (`encode_special_tokens`,
transformers' `split_special_tokens`), and the pieces are joined.

A template that rewrites message text (`content | trim`, `messages | tojson`) cannot be
split that way; a conversation whose text spells control tokens is then refused
(`InvalidRequest`) rather than encoded with forged ones.

In the common case, given a `cache_namespace` (the gateway passes the tenant), the real
rendering is encoded piece by piece between its added tokens through `PieceCache`
(`backend/piece_cache.py`): the same ids, with the pieces an earlier request already encoded
(the system prompt, a conversation's earlier turns) taken from the cache.

Incremental detokenisation (streaming)
--------------------------------------
A token is a sequence of bytes, not of characters: a byte-level BPE can cut one emoji
into three tokens, and decoding the first one alone gives U+FFFD. Decoding token by token
and concatenating is therefore wrong, and decoding the whole sequence on every step is
quadratic. `IncrementalDetokenizer` keeps a small window of ids and two offsets into it
(the technique of vLLM and TGI):

    ids:  ... | prefix ........ | read ....... new |
              ^ prefix_offset   ^ read_offset

`prefix_text = decode(ids[prefix:read])` is text already emitted (it is decoded again only
to give the decoder left context: sentencepiece-style decoders drop a leading space at
the start of a decode). On each new id, `new_text = decode(ids[prefix:])`; if it grew and
does not end in U+FFFD, the tail `new_text[len(prefix_text):]` is emitted and both
offsets move right (`prefix = read; read = len(ids)`). If it ends in U+FFFD the last
character is incomplete, so nothing is emitted and the ids are kept until the character
completes. Ids before `prefix` are never needed again and are dropped, so each step
decodes a handful of tokens. `flush()` emits whatever is held when the stream ends
(U+FFFD included, exactly as `decode` of the whole sequence would show it).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _BackendTokenizer

from backend.errors import InvalidRequest, ModelLoadError
from backend.piece_cache import PieceCache

__all__ = ["Tokenizer", "IncrementalDetokenizer"]

logger = logging.getLogger(__name__)

_REPLACEMENT = "\ufffd"
_SHORT_TEXT = 1024  # characters: encoded holding the GIL (under ~0.6 ms), longer ones release it
# Placeholder for message i while rendering: private-use code points that templates never write.
_PLACEHOLDER = "\ue000{}\ue001"
_PLACEHOLDER_RE = re.compile("\ue000(\\d+)\ue001")
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or an AddedToken dict."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class Tokenizer:
    """Encode, decode and chat-template for one model."""

    def __init__(
        self,
        backend: _BackendTokenizer,
        *,
        special_tokens: Mapping[str, str | None] | None = None,
        chat_template: str | None = None,
        bos_token_id: int | None = None,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        self._backend = backend
        self._special_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        self._special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self._chat_template = chat_template
        self._bos_token_id = bos_token_id
        self._eos_token_ids = eos_token_ids

    @classmethod
    def from_model_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load from a Hugging Face-format folder (needs `tokenizer.json`)."""
        folder = Path(path)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelLoadError(f"{folder} has no tokenizer.json")
        backend = _BackendTokenizer.from_file(str(tokenizer_file))
        tok_config = _read_json(folder / "tokenizer_config.json")
        config = _read_json(folder / "config.json")
        generation = _read_json(folder / "generation_config.json")

        special = {name: _token_text(tok_config.get(name)) for name in _SPECIAL_NAMES}
        template = tok_config.get("chat_template")
        if isinstance(template, list):  # several named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_file = folder / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")

        def id_of(token: str | None) -> list[int]:
            index = backend.token_to_id(token) if token else None
            return [] if index is None else [index]

        bos_ids = _as_ids(config.get("bos_token_id")) or _as_ids(generation.get("bos_token_id"))
        bos_ids = bos_ids or id_of(special["bos_token"])
        eos_ids = frozenset(
            _as_ids(config.get("eos_token_id")) + _as_ids(generation.get("eos_token_id")) + id_of(special["eos_token"])
        )
        logger.debug("tokenizer %s: vocab %d, eos %s", folder, backend.get_vocab_size(), sorted(eos_ids))
        return cls(
            backend,
            special_tokens=special,
            chat_template=template,
            bos_token_id=bos_ids[0] if bos_ids else None,
            eos_token_ids=eos_ids,
        )

    @property
    def bos_token_id(self) -> int | None:
        """Beginning-of-sequence id, if the model has one."""
        return self._bos_token_id

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends generation (config, generation_config and tokenizer_config together)."""
        return self._eos_token_ids

    def backend_json(self) -> str:
        """The whole `tokenizer.json` pipeline as a string, padding and truncation off (what
        llguidance builds its token trie from, `backend/grammar.py`)."""
        backend = copy.copy(self._backend)
        backend.no_padding()
        backend.no_truncation()
        return backend.to_str()

    @property
    def vocab_size(self) -> int:
        """Tokens the tokenizer knows, added tokens included (the model's embedding may be larger)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @cached_property
    def control_tokens(self) -> list[str]:
        """Text of every special added token (what `encode` turns into a control token)."""
        decoder = self._backend.get_added_tokens_decoder()
        return [decoder[i].content for i in sorted(self._special_ids)]

    @property
    def special_tokens(self) -> dict[str, str]:
        """Special token strings by role (`bos_token`, `eos_token`, ...)."""
        return dict(self._special_tokens)

    @property
    def chat_template(self) -> str | None:
        """The jinja2 chat template source, if the model has one."""
        return self._chat_template

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of `token_id` (byte-level spelling), or None when out of range."""
        return self._backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary entry, or None."""
        return self._backend.token_to_id(token)

    def encode(self, text: str, *, add_special_tokens: bool = False, split_special_tokens: bool = False,
               cache_namespace: str | None = None) -> list[int]:
        """Token ids of `text`. Special tokens written in the text (`<|im_start|>`) are matched whole,
        or, with `split_special_tokens`, encoded as the plain text they spell. `add_special_tokens`
        adds what the post-processor adds (e.g. BOS), off by default because chat templates write
        their own. Releases the GIL while it encodes, so a thread can take a large text off an event loop.
        `cache_namespace` (special tokens matched, none added): the pieces between added tokens are
        looked up in, and kept in, this tokenizer's `PieceCache` under that namespace (same ids)."""
        if cache_namespace is not None and not (add_special_tokens or split_special_tokens):
            return self._encode_pieces(text, cache_namespace)
        return self._encode_batch([text], split_special_tokens, add_special_tokens)[0]

    @cached_property
    def piece_cache(self) -> PieceCache | None:
        """The cache `cache_namespace` encodes through (its `hits` / `misses` for metrics), or None where this
        pipeline encodes whole (`PieceCache.for_backend`). Built on first use (probe texts, ~1 ms)."""
        return PieceCache.for_backend(self._backend)

    def _encode_pieces(self, text: str, namespace: str) -> list[int]:
        cache = self.piece_cache
        return cache.encode(text, namespace) if cache is not None else self._encode_batch([text], False)[0]

    @cached_property
    def _plain(self) -> _BackendTokenizer:
        """A copy that encodes special-token text as plain text (built on first use: ~0.1 s). A copy
        rather than a toggle on the shared one, because encoding runs in threads (it releases the GIL)."""
        plain = copy.deepcopy(self._backend)
        plain.encode_special_tokens = True
        return plain

    def _encode_batch(self, texts: list[str], split_special_tokens: bool, add_special_tokens: bool = False
                      ) -> list[list[int]]:
        backend = self._plain if split_special_tokens else self._backend
        if len(texts) == 1 and len(texts[0]) < _SHORT_TEXT:  # encode: no thread pool round trip (74 vs 92 us)
            return [backend.encode(texts[0], add_special_tokens=add_special_tokens).ids]
        # encode_batch, unlike encode, releases the GIL (measured: a 300 KB text blocked the loop 0.1 s)
        return [e.ids for e in backend.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                    cache_namespace: str | None = None, **template_vars: Any) -> list[int]:
        """Token ids of `messages` rendered with the chat template, where control tokens come only
        from the template: special-token text inside a message's content stays text (module doc).
        `cache_namespace`: the common case's pieces go through the `PieceCache` (`encode`).

        Raises `InvalidRequest` when the template rejects the conversation, or when it rewrites
        message text that spells special tokens (the one case that cannot be encoded safely).
        """
        real = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **template_vars)
        contents = [m.get("content") for m in messages]
        marked = self.apply_chat_template(
            [{**m, "content": _PLACEHOLDER.format(i)} if isinstance(c, str) else m
             for i, (m, c) in enumerate(zip(messages, contents, strict=True))],
            add_generation_prompt=add_generation_prompt, **template_vars)
        parts = _PLACEHOLDER_RE.split(marked)  # template, message index, template, ..., message index, template
        template_parts, texts = parts[0::2], [contents[int(i)] for i in parts[1::2]]
        verbatim = "".join(p for pair in zip(template_parts, [*texts, ""], strict=True) for p in pair) == real
        if verbatim and all(self._inert(t) for t in texts):  # no control token can touch message text
            if cache_namespace is not None:
                return self._encode_pieces(real, cache_namespace)
            return self._encode_batch([real], split_special_tokens=False)[0]
        ids, own_ids = self._encode_batch([real, marked], split_special_tokens=False)
        if self._specials(ids) == self._specials(own_ids):
            return ids
        if not verbatim:
            raise InvalidRequest("message text spells this model's control tokens and its chat template "
                                 "rewrites message text, so they cannot be kept as plain text", field="messages")
        template_ids = self._encode_batch(template_parts, split_special_tokens=False)
        text_ids = self._encode_batch(texts, split_special_tokens=True) if texts else []
        ids = template_ids[0]
        for text, template in zip(text_ids, template_ids[1:], strict=True):
            ids += text + template
        return ids

    @cached_property
    def _control_edges(self) -> tuple[frozenset[str], Any]:
        """First and last characters of every control token, and the normaliser added tokens may match after."""
        edges = frozenset(c for t in self.control_tokens if t for c in (t[0], t[-1]))
        return edges, self._backend.normalizer

    def _inert(self, text: str) -> bool:
        """Whether no control token can match any part of `text` wherever a template puts it: a match that
        touches the text starts or ends inside it (so the text holds a control token's first or last
        character, also after the normaliser) or covers it whole (so the text is part of a control token)."""
        edges, normalizer = self._control_edges
        seen = (text, normalizer.normalize_str(text)) if normalizer is not None else (text,)
        return all(s and not any(c in s for c in edges) and not any(s in t for t in self.control_tokens)
                   for s in seen)

    def _specials(self, ids: list[int]) -> list[int]:
        return [i for i in ids if i in self._special_ids]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True,
               keep_special_ids: frozenset[int] = frozenset()) -> str:
        """Text of `ids`; an incomplete UTF-8 sequence shows as U+FFFD. With `skip_special_tokens`,
        special tokens are left out except those in `keep_special_ids` (the markers a tool-call or
        reasoning parser reads, such as Kimi's `<|tool_calls_section_begin|>`), which keep their text."""
        if skip_special_tokens and keep_special_ids:
            ids = [i for i in ids if i not in self._special_ids or i in keep_special_ids]
            skip_special_tokens = False
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def special_ids_of(self, markers: Sequence[str]) -> frozenset[int]:
        """Ids of those `markers` that are special tokens of this tokenizer (the others are plain text)."""
        ids = (self._backend.token_to_id(m) for m in markers if m)
        return frozenset(i for i in ids if i is not None and i in self._special_ids)

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        if self._chat_template is None:
            raise InvalidRequest("this model has no chat template")
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        return env.from_string(self._chat_template)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True, **template_vars: Any
    ) -> str:
        """Render `messages` into the prompt string (not tokenised). Extra keyword arguments
        (`tools=...`, `documents=...`) reach the template as variables.

        Raises `InvalidRequest` when the template rejects the conversation (`raise_exception`).
        """
        context: dict[str, Any] = {"tools": None, "documents": None, **self._special_tokens, **template_vars}
        plain_messages = [dict(message) for message in messages]
        try:
            return self._compiled_template.render(
                messages=plain_messages, add_generation_prompt=add_generation_prompt, **context
            )
        except jinja2.exceptions.TemplateError as exc:
            raise InvalidRequest(f"chat template rejected the conversation: {exc}") from exc


class IncrementalDetokenizer:
    """Turns a stream of token ids into text pieces that never split a character.

    `push(id)` returns only text completed by that id ("" while a character is incomplete);
    `flush()` returns what is still held. The concatenation of all returned pieces equals
    `tokenizer.decode(all pushed ids)`. `prompt_ids` only give left context (their last
    few ids); their text is never returned. Special tokens are skipped, except
    `keep_special_ids` (markers a parser needs, `Tokenizer.decode`).
    """

    PROMPT_CONTEXT = 5  # prompt ids kept as left context, as vLLM does

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True,
                 keep_special_ids: frozenset[int] = frozenset()) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._keep = keep_special_ids
        self._window: list[int] = list(prompt_ids[max(0, len(prompt_ids) - self.PROMPT_CONTEXT) :])
        self._read = len(self._window)  # window[:read] is already accounted for
        self._prefix_text = self._decode(self._window)

    def _decode(self, ids: Sequence[int]) -> str:
        if self._keep:
            return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens, keep_special_ids=self._keep)
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one generated id; return the newly completed text (maybe "")."""
        self._window.append(token_id)
        text = self._decode(self._window)
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT):
            return ""
        return self._advance(text)

    def flush(self) -> str:
        """End of stream: return all held-back text, even an incomplete character."""
        text = self._decode(self._window)
        return self._advance(text) if len(text) > len(self._prefix_text) else ""

    def _advance(self, text: str) -> str:
        piece = text[len(self._prefix_text) :]
        # The new prefix is what lay between the old read offset and the end.
        self._window = self._window[self._read :]
        self._read = len(self._window)
        self._prefix_text = self._decode(self._window)
        return piece
