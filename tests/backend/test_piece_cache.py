"""`PieceCache`: prompts encoded piece by piece between added tokens give exactly the ids of encoding them whole
(SmolLM2's real tokenizer, random texts around its control tokens), pieces come back from the cache per namespace
within its character budget, and pipelines where a piece's ids could depend on its place get no cache."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer as BackendTokenizer, models, normalizers, pre_tokenizers

from backend.piece_cache import PieceCache
from backend.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer.from_model_dir(smollm2_dir)


def _texts(tokenizer: Tokenizer, seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    specials = tokenizer.control_tokens[:6]
    alphabet = list("abc xyz  \n\n\t0123456789.,'-") + ["é", "ü", "中", "👋", "\u00a0", "\r\n"]
    out = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(1, 8)):
            if rng.random() < 0.4:
                parts.append(rng.choice(specials))
            parts.append("".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12))))
        out.append("".join(parts))
    return out


def _kept(cache: PieceCache, namespace: str, piece: str) -> bool:
    return piece in cache._spaces.get(namespace, {})


def test_pieces_give_the_whole_texts_ids(tokenizer: Tokenizer) -> None:
    cache = PieceCache.for_backend(tokenizer._backend)
    assert cache is not None
    texts = _texts(tokenizer, 0, 300)
    for text in texts + texts:  # the second pass from the cache
        assert cache.encode(text, "t") == tokenizer._backend.encode(text, add_special_tokens=False).ids, repr(text)
    assert cache.hits > cache.misses > 0


def test_encode_chat_with_a_namespace_is_the_same_and_encodes_only_new_pieces(tokenizer: Tokenizer) -> None:
    rng = random.Random(1)
    words = "alpha beta gamma delta 42 héllo 👋 \n".split(" ")
    turns = [{"role": "system", "content": "You are terse."}]
    cache = tokenizer.piece_cache
    assert cache is not None
    for i in range(12):
        turns.append({"role": "user" if i % 2 == 0 else "assistant",
                      "content": " ".join(rng.choice(words) for _ in range(rng.randint(1, 30)))})
        misses = cache.misses
        assert tokenizer.encode_chat(turns, cache_namespace="tenant-a") == tokenizer.encode_chat(turns), i
        if i:  # the earlier turns came from the cache: the new message's piece and the generation prompt's
            assert cache.misses - misses <= 2, i
    assert tokenizer.encode("<|im_start|>user\nhi<|im_end|>", cache_namespace="t") == \
        tokenizer.encode("<|im_start|>user\nhi<|im_end|>")


def test_namespaces_do_not_share_pieces(tokenizer: Tokenizer) -> None:
    cache = PieceCache.for_backend(tokenizer._backend)
    text = "<|im_start|>system\nshared system prompt<|im_end|>"
    cache.encode(text, "a")
    hits, misses = cache.hits, cache.misses
    cache.encode(text, "b")
    assert (cache.hits, cache.misses) == (hits, misses + 1)  # its one piece ("system\n..."), encoded anew
    cache.encode(text, "a")
    assert cache.hits == hits + 1


def test_the_cache_keeps_to_its_budget_and_stays_exact(tokenizer: Tokenizer) -> None:
    cache = PieceCache.for_backend(tokenizer._backend, max_chars=400, share=1.0)
    texts = [f"<|im_start|>user\nmessage number {i} {'x' * (i % 50)}<|im_end|>" for i in range(200)]
    for text in texts + texts[:20]:  # the first ones were evicted: encoded again, the same
        assert cache.encode(text) == tokenizer._backend.encode(text, add_special_tokens=False).ids
        assert cache._chars <= 400
    assert not _kept(cache, "", "user\nmessage number 0 ") and _kept(cache, "", "user\nmessage number 19 " + "x" * 19)
    cache.encode("y" * 500)  # longer than the budget: encoded, not kept
    assert not _kept(cache, "", "y" * 500)


def test_a_namespace_keeps_to_its_share_and_idle_ones_go_first(tokenizer: Tokenizer) -> None:
    """A tenant that floods the cache evicts its own pieces past its share; when the whole is full, the
    namespace used least recently loses its oldest pieces first, not the busy ones."""
    cache = PieceCache.for_backend(tokenizer._backend, max_chars=1000, share=0.4)
    piece = "user\n" + "z" * 95  # 100 characters
    for ns in ("quiet", "a", "b"):
        cache.encode(f"<|im_start|>{piece}<|im_end|>", ns)
    for i in range(30):  # "flood" writes 3,000 characters: only its latest 400 stay
        cache.encode(f"<|im_start|>user\n{i:04d}{'w' * 91}<|im_end|>", "flood")  # 100 characters
        assert cache._ns_chars["flood"] <= 400
    assert all(_kept(cache, ns, piece) for ns in ("quiet", "a", "b"))  # nobody else lost anything
    cache.encode(f"<|im_start|>{piece}<|im_end|>", "a")  # a and b busy, quiet idle
    cache.encode(f"<|im_start|>{piece}<|im_end|>", "b")
    for ns in ("c", "d", "e", "f"):  # 700 characters kept + 400 new, over the budget of 1,000 by 100
        cache.encode(f"<|im_start|>{piece}<|im_end|>", ns)
    assert cache._chars == 1000 and cache._ns_chars["flood"] == 400
    assert not _kept(cache, "quiet", piece) and _kept(cache, "a", piece) and _kept(cache, "b", piece)


def test_concurrent_encodes_stay_exact(tokenizer: Tokenizer) -> None:
    cache = PieceCache.for_backend(tokenizer._backend, max_chars=2000)
    texts = _texts(tokenizer, 2, 120)
    expected = [tokenizer._backend.encode(t, add_special_tokens=False).ids for t in texts]

    async def go() -> list[list[int]]:
        return await asyncio.gather(*(asyncio.to_thread(cache.encode, t, str(i % 3)) for i, t in enumerate(texts)))

    assert asyncio.run(go()) == expected


def _word_level(pre_tokenizer=None, normalizer=None, special: AddedToken | None = None) -> BackendTokenizer:
    vocab = {"[UNK]": 0, "▁hello": 1, "hello": 2, "world": 3, "▁world": 4}
    backend = BackendTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizer or pre_tokenizers.Whitespace()
    if normalizer is not None:
        backend.normalizer = normalizer
    backend.add_special_tokens([special or AddedToken("<s>", special=True)])
    return backend


def test_pipelines_that_see_the_whole_input_get_no_cache() -> None:
    assert PieceCache.for_backend(_word_level()) is not None
    assert PieceCache.for_backend(_word_level(pre_tokenizers.Metaspace())) is None
    assert PieceCache.for_backend(_word_level(normalizer=normalizers.Sequence([normalizers.Prepend("▁")]))) is None
    assert PieceCache.for_backend(_word_level(special=AddedToken("<s>", special=True, rstrip=True))) is None
    assert PieceCache.for_backend(_word_level(special=AddedToken("<s>", special=True, lstrip=True))) is None
    assert PieceCache.for_backend(_word_level(special=AddedToken("<s>", special=True, single_word=True))) is None
    plain = _word_level()
    assert PieceCache.for_backend(plain).encode("hello<s> world<s>") == plain.encode("hello<s> world<s>").ids


def test_tokens_matched_after_normalisation_come_second() -> None:
    """tokenizers matches the added tokens that are not normalised first, then the normalised ones in the text
    between them: a normalised token inside a special one's text is not matched."""
    backend = _word_level()
    backend.add_tokens([AddedToken("lo<", normalized=True), AddedToken("wor", normalized=True)])
    cache = PieceCache.for_backend(backend)
    assert cache is not None
    # "hello<s>": one pass, leftmost first, would take "lo<" and leave "s>"; tokenizers takes "<s>"
    assert backend.encode("hello<s>").ids[-1] == backend.token_to_id("<s>")
    for text in ("hello<s>", "hello<s>world", "<s>lo<", "lo< world<s>wor", "hello world"):
        assert cache.encode(text) == backend.encode(text, add_special_tokens=False).ids, text
