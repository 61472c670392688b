"""The grammars behind `tool_choice` "required" / named (gateway/tool_grammar.py), on SmolLM2's real
vocabulary (and one with Kimi's markers and <think> added as special tokens): recorded calls of each
family are allowed token by token, anything else is refused at the first wrong token, and random walks
through the masks always end in calls the family's parser reads with arguments valid for the tool."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import jsonschema
import pytest
import torch
from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

from backend.errors import InvalidRequest, InvalidSamplingParams
from backend.grammar import GrammarCompiler, allowed_tokens
from backend.tokenizer import Tokenizer
from gateway.tool_grammar import tool_choice_grammar
from gateway.tool_parsers import TOOL_PARSERS
from gateway.tool_parsers.base import collect

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1},
                                            "unit": {"type": "string", "enum": ["C", "F"]}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "list_files"}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
KIMI_MARKERS = ["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<think>", "</think>"]


BIT = torch.arange(32, dtype=torch.int32)  # bit i of a mask word is token 32 * word + i


def allows(mask, token: int) -> bool:
    """Whether a [words] bitmask allows `token` (bit token % 32 of word token // 32)."""
    return bool((int(mask[token // 32]) >> (token % 32)) & 1)


class Vocab:
    def __init__(self, folder: Path) -> None:
        self.tok = Tokenizer.from_model_dir(folder)
        self.compiler = GrammarCompiler(self.tok.backend_json(), self.tok.vocab_size, self.tok.eos_token_ids)

    def refused_at(self, spec, text: str) -> str | None:
        """None if the grammar allows `text` token by token (and may end there), else where it refuses."""
        state = self.compiler.state(spec)
        ids = self.tok.encode(text)
        for i, t in enumerate(ids):
            if not allows(state.mask, t):
                return self.tok.decode(ids[:i], skip_special_tokens=False)
            state.advance(t)
        ends = set(allowed_tokens(state.mask, self.tok.vocab_size)) & self.tok.eos_token_ids
        return None if ends or state.done else "<no end>"


@pytest.fixture(scope="module")
def smol(smollm2_dir: Path) -> Vocab:
    return Vocab(smollm2_dir)


@pytest.fixture(scope="module")
def kimi(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Vocab:
    folder = tmp_path_factory.mktemp("kimi-vocab")
    backend = BackendTokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    backend.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in KIMI_MARKERS])
    backend.save(str(folder / "tokenizer.json"))
    for name in ("tokenizer_config.json", "generation_config.json"):
        shutil.copy(smollm2_dir / name, folder / name)
    return Vocab(folder)


HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
GLM_CALL = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris, \"FR\"</arg_value>\n"
            "<arg_key>unit</arg_key>\n<arg_value>C</arg_value>\n</tool_call>")
KIMI_CALL = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
             '{"city": "Rome"}<|tool_call_end|><|tool_calls_section_end|>')

# (parser, choice, output, None if allowed else the text before the first refused token)
CASES = [
    ("hermes", "required", HERMES_CALL, None),
    ("hermes", "required", HERMES_CALL + '\n<tool_call>\n{"name": "list_files", "arguments": {}}\n</tool_call>', None),
    ("hermes", NAMED, HERMES_CALL, None),
    ("hermes", {"type": "function", "function": {"name": "list_files"}}, HERMES_CALL, '<tool_call>\n{"name": "'),
    ("hermes", "required", "Sure, calling it.", ""),  # no text before or instead of the call
    ("hermes", "required", '<tool_call>\n{"name": "get_weather", "arguments": {"days": 2}}\n</tool_call>',
     '<tool_call>\n{"name": "get_weather", "arguments": {"'),  # `city` is required
    ("hermes", "required", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "x": 1}}\n</tool_call>',
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "'),  # no invented keys
    ("glm45", "required", GLM_CALL + "\n<tool_call>list_files</tool_call>", None),
    ("glm45", NAMED, "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>x</arg_value>\n"
                     "<arg_key>unit</arg_key>\n<arg_value>K</arg_value>", "<tool_call>get_weather\n<arg_key>city"
                     "</arg_key>\n<arg_value>x</arg_value>\n<arg_key>unit</arg_key>\n<arg_value>"),
    ("kimi_k2", "required", KIMI_CALL, None),
]


@pytest.mark.parametrize("name,choice,text,refused", CASES)
def test_recorded_calls_allowed_and_others_refused(smol: Vocab, name: str, choice, text: str, refused) -> None:
    spec = tool_choice_grammar(TOOL_PARSERS[name], TOOLS, choice, smol.tok)
    assert smol.refused_at(spec, text) == refused
    if refused is None:  # what the grammar allows, the parser reads as valid calls
        _, calls = collect(TOOL_PARSERS[name](TOOLS).parse_whole(text))
        assert calls and all(c.name in ("get_weather", "list_files") for c in calls)
        jsonschema.validate(json.loads(calls[0].arguments), WEATHER)


def test_special_token_markers_are_matched_as_tokens_never_as_text(kimi: Vocab) -> None:
    spec = tool_choice_grammar(TOOL_PARSERS["kimi_k2"], TOOLS, "required", kimi.tok)
    assert spec.schema.startswith("start: <|tool_calls_section_begin|> call+ <|tool_calls_section_end|>")
    assert kimi.refused_at(spec, KIMI_CALL) is None  # encoded with the markers as their special tokens
    as_text = kimi.tok.encode(KIMI_CALL[:28], split_special_tokens=True)
    state = kimi.compiler.state(spec)
    assert allowed_tokens(state.mask, kimi.tok.vocab_size) == [kimi.tok.token_to_id(KIMI_MARKERS[0])]
    assert as_text[0] != kimi.tok.token_to_id(KIMI_MARKERS[0])


def test_reasoning_comes_first_and_must_close_when_the_prompt_opened_it(kimi: Vocab) -> None:
    parser = TOOL_PARSERS["kimi_k2"]
    optional = tool_choice_grammar(parser, TOOLS, NAMED, kimi.tok, reasoning=("<think>", "</think>", False))
    assert kimi.refused_at(optional, "<think>Rome, so the weather tool.</think>\n" + KIMI_CALL) is None
    assert kimi.refused_at(optional, KIMI_CALL) is None
    opened = tool_choice_grammar(parser, TOOLS, NAMED, kimi.tok, reasoning=("<think>", "</think>", False),
                                 in_think=True)
    assert kimi.refused_at(opened, "It is Rome.</think>" + KIMI_CALL) is None
    assert kimi.refused_at(opened, "It is Rome. " + KIMI_CALL) == "It is Rome. "  # no call before </think>


def test_what_a_format_cannot_enforce_is_a_typed_400(smol: Vocab) -> None:
    glm = TOOL_PARSERS["glm45"]
    for params, why in [({"type": "object", "properties": {"id": {"type": "string", "pattern": "^[a-z]+$"}}}, "pattern"),
                        ({"type": "object", "patternProperties": {"^x": {}}}, "patternProperties"),
                        ({"anyOf": [{"type": "object"}]}, "anyOf")]:
        tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
        with pytest.raises(InvalidSamplingParams, match=why) as info:
            tool_choice_grammar(glm, tools, "required", smol.tok)
        assert info.value.details.get("field") == "tool_choice" and info.value.http_status == 400
        tool_choice_grammar(TOOL_PARSERS["hermes"], tools, "required", smol.tok)  # JSON formats take them
    with pytest.raises(InvalidRequest) as info:
        tool_choice_grammar(glm, TOOLS, {"type": "function", "function": {"name": "nope"}}, smol.tok)
    assert info.value.details.get("field") == "tool_choice.function.name"
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "n": {"$ref": "#/$defs/missing"}}}}}]
    with pytest.raises(InvalidSamplingParams, match="cannot be enforced"):  # llguidance refuses the schema
        tool_choice_grammar(TOOL_PARSERS["hermes"], bad, "required", smol.tok)


WALK_TOOLS = [{"type": "function", "function": {"name": "set_mode", "parameters": {
    "type": "object", "properties": {"mode": {"type": "string", "enum": ["fast", "slow", "off"]},
                                     "level": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "on": {"type": "boolean"},
                                     "opts": {"type": "object", "properties": {"k": {"enum": [1, 2, "x"]}},
                                              "required": ["k"], "additionalProperties": False}},
    "required": ["mode", "on"]}}}, {"type": "function", "function": {"name": "ping"}}]


@pytest.mark.parametrize("name,vocab", [("hermes", "smol"), ("glm45", "smol"), ("kimi_k2", "kimi")])
def test_random_walks_under_the_grammar_always_parse_and_validate(name: str, vocab: str,
                                                                  request: pytest.FixtureRequest) -> None:
    v: Vocab = request.getfixturevalue(vocab)
    rng = random.Random()
    schemas = {t["function"]["name"]: t["function"].get("parameters", {"type": "object", "properties": {}})
               for t in WALK_TOOLS}
    for choice in ("required", {"type": "function", "function": {"name": "set_mode"}}):
        spec = tool_choice_grammar(TOOL_PARSERS[name], WALK_TOOLS, choice, v.tok)
        for _ in range(3):
            state, ids = v.compiler.state(spec), []
            while not state.done:
                allowed = ((state.mask.unsqueeze(-1) >> BIT) & 1).flatten()[:v.tok.vocab_size].bool()  # [vocab]
                eos = list(v.tok.eos_token_ids)
                if allowed[eos].any() and (len(ids) > 60 or rng.random() < 0.7):
                    break
                allowed[eos] = False
                choices = allowed.nonzero().flatten()
                token = int(choices[rng.randrange(len(choices))])
                state.advance(token)
                ids.append(token)
                assert len(ids) < 400
            keep = v.tok.special_ids_of(TOOL_PARSERS[name].MARKERS)
            text = v.tok.decode(ids, keep_special_ids=keep)
            content, calls = collect(TOOL_PARSERS[name](WALK_TOOLS).parse_whole(text))
            assert calls and content == "", text
            for call in calls:
                assert choice == "required" or call.name == "set_mode"
                jsonschema.validate(json.loads(call.arguments), schemas[call.name])
