"""Lark grammars (`GrammarSpec("lark", ...)`, what the gateway sends for `tool_choice` "required" /
named) in backend/grammar.py: checked without a tokenizer, compiled once per text, masks that follow
the grammar on SmolLM2's vocabulary, special-token references, and typed errors naming tool_choice."""

from __future__ import annotations

from pathlib import Path

import pytest

from backend.errors import InvalidSamplingParams
from backend.grammar import GrammarCompiler, allowed_tokens, grammar_of
from backend.sampling_params import GrammarSpec
from backend.tokenizer import Tokenizer

LARK = 'start: <|im_start|> ("yes" | "no") args\nargs: %json {"type": "object", "properties": {"n": {"enum": [1, 2]}}, "required": ["n"], "additionalProperties": false}'


@pytest.fixture(scope="module")
def vocab(smollm2_dir: Path) -> tuple[Tokenizer, GrammarCompiler]:
    tok = Tokenizer.from_model_dir(smollm2_dir)
    return tok, GrammarCompiler(tok.backend_json(), tok.vocab_size, tok.eos_token_ids)


def test_lark_masks_follow_the_grammar(vocab: tuple[Tokenizer, GrammarCompiler]) -> None:
    tok, compiler = vocab
    state = compiler.state(GrammarSpec("lark", LARK))
    assert allowed_tokens(state.mask, tok.vocab_size) == [tok.token_to_id("<|im_start|>")]
    for token in tok.encode('<|im_start|>yes{"n": 2}'):
        assert token in allowed_tokens(state.mask, tok.vocab_size)
        state.advance(token)
    assert set(allowed_tokens(state.mask, tok.vocab_size)) <= tok.eos_token_ids and state.done
    assert len(compiler.compile_s) == 1
    compiler.state(GrammarSpec("lark", LARK))  # the same text: from the cache
    assert len(compiler.compile_s) == 1


def test_bad_lark_is_a_typed_error_naming_tool_choice(vocab: tuple[Tokenizer, GrammarCompiler]) -> None:
    _, compiler = vocab
    for text in ("start: (", "start: undefined_rule", 'start: "a"\nstart: "b"\nx: %json {"type": 7}'):
        with pytest.raises(InvalidSamplingParams) as info:
            grammar_of(GrammarSpec("lark", text))
        assert info.value.details.get("field") == "tool_choice"
    with pytest.raises(InvalidSamplingParams) as info:  # valid syntax, but a token this vocabulary lacks
        compiler.state(GrammarSpec("lark", 'start: <|no_such_token|> "x"'))
    assert info.value.details.get("field") == "tool_choice"
