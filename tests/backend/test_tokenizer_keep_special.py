"""Decoding that keeps the special tokens a parser reads (Kimi's tool-call markers, `<think>`) and skips
every other special token, whole and streamed, on SmolLM2's tokenizer with Kimi's markers added."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

from backend.tokenizer import IncrementalDetokenizer, Tokenizer

MARKERS = ["<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>",
           "<|tool_calls_section_end|>", "<think>", "</think>"]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("kimi-markers")
    backend = BackendTokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    backend.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in MARKERS])
    backend.add_tokens([AddedToken("<plain_added>", special=False, normalized=False)])
    backend.save(str(folder / "tokenizer.json"))
    for name in ("tokenizer_config.json", "generation_config.json"):
        shutil.copy(smollm2_dir / name, folder / name)
    return Tokenizer.from_model_dir(folder)


def test_kept_markers_keep_their_text_and_other_specials_are_skipped(tokenizer: Tokenizer) -> None:
    keep = tokenizer.special_ids_of(MARKERS[:5])
    assert len(keep) == 5 and tokenizer.special_ids_of(["<tool_call>", "hello", "<plain_added>"]) == frozenset()
    text = ("<|im_start|>Let me call.<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
            '<|tool_call_argument_begin|>{"a": "é☃"}<|tool_call_end|><|tool_calls_section_end|><think><|im_end|>')
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids, keep_special_ids=keep) == text.replace("<|im_start|>", "").replace(
        "<think><|im_end|>", "")
    assert tokenizer.decode(ids) == 'Let me call.functions.f:0{"a": "é☃"}'  # the default drops them all
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_streamed_with_kept_markers_equals_whole_decode(tokenizer: Tokenizer) -> None:
    keep = tokenizer.special_ids_of(MARKERS)
    rng = random.Random()
    pool = [*(tokenizer.token_to_id(m) for m in MARKERS), *(tokenizer.encode("<|im_end|><|endoftext|>")),
            *tokenizer.encode("Weather in Zürich ☃, 21°C {\"x\": 1}")]
    for _ in range(20):
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 40))]
        detok = IncrementalDetokenizer(tokenizer, [1, 2, 3], keep_special_ids=keep)
        pieces = [detok.push(i) for i in ids] + [detok.flush()]
        assert "".join(pieces) == tokenizer.decode(ids, keep_special_ids=keep)
