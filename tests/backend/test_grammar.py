"""Structured output: llguidance masks against a brute-force reading of the real SmolLM2 vocabulary,
the batched mask in the sampler, and the engine over 60 generated JSON schemas (every finished
output validates; a cut one ends with "length")."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch

from backend.engine import EngineConfig, LLMEngine
from backend.errors import InvalidSamplingParams
from backend.grammar import GrammarCompiler, allowed_tokens, apply_masks, grammar_of
from backend.sampler import sample
from backend.sampling_params import GrammarSpec, SamplingParams
from backend.tokenizer import Tokenizer
from ops.bench.structured import schemas


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer.from_model_dir(smollm2_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer.backend_json(), 49152, tokenizer.eos_token_ids)


def _spec(schema: dict) -> GrammarSpec:
    return GrammarSpec("json_schema", json.dumps(schema))


def test_mask_allows_exactly_the_tokens_that_continue_a_valid_document(tokenizer: Tokenizer,
                                                                       compiler: GrammarCompiler) -> None:
    docs = ['"yes"', '"no"', '"maybe"']  # compact JSON: these three strings and nothing else
    state = compiler.state(_spec({"enum": ["yes", "no", "maybe"]}))
    texts = {i: tokenizer.decode([i], skip_special_tokens=False) for i in range(49152)}
    consumed = ""
    for step in range(20):
        want = {i for i, t in texts.items() if t and i not in tokenizer.eos_token_ids
                and any(d.startswith(consumed + t) for d in docs)}
        got = set(allowed_tokens(state.mask, 49152))
        if consumed in docs:
            assert got == set(tokenizer.eos_token_ids) & got and got  # only EOS once complete
            assert state.done
            break
        assert got == want, (consumed, sorted(got ^ want)[:10])
        tok = min(want, key=lambda i: (-len(texts[i]), i)) if step else tokenizer.encode('"', add_special_tokens=False)[0]
        state.advance(tok)
        consumed += texts[tok]
    assert consumed in docs


def test_compiled_once_per_schema_and_invalid_schemas_refused(compiler: GrammarCompiler) -> None:
    spec = _spec({"type": "object", "properties": {"a": {"type": "integer"}}})
    before = len(compiler.compile_s)
    a, b = compiler.state(spec), compiler.state(spec)
    assert len(compiler.compile_s) == before + 1 and a.matcher is not b.matcher
    for bad in ('{"type": "nope"}', "[1, 2]", "not json", '{"$ref": "#/defs/missing"}'):
        with pytest.raises(InvalidSamplingParams) as info:
            grammar_of(GrammarSpec("json_schema", bad))
        assert info.value.details["field"] == "response_format"
    assert grammar_of(GrammarSpec("json_object"))


def test_apply_masks_only_touches_masked_rows() -> None:
    vocab = 70  # not a multiple of 32
    logits = torch.randn(3, vocab)
    assert apply_masks(logits, [None, None, None]) is logits
    mask = torch.randint(-2**31, 2**31 - 1, (3,), dtype=torch.int32)
    out = apply_masks(logits, [None, mask, None])
    allowed = set(allowed_tokens(mask, vocab))
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    for t in range(vocab):
        assert (out[1, t] == logits[1, t]) if t in allowed else out[1, t] == float("-inf")
    greedy = sample(logits, [SamplingParams(temperature=0)] * 3, [None] * 3, masks=[None, mask, None])
    assert greedy[1] in allowed and greedy[0] == int(logits[0].argmax()) and greedy[2] == int(logits[2].argmax())


def test_apply_masks_kernel_and_torch_paths_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    import backend.grammar as grammar

    logits = torch.randn(4, 1000)
    masks = [torch.randint(-2**31, 2**31 - 1, (32,), dtype=torch.int32), None, torch.zeros(32, dtype=torch.int32),
             torch.full((32,), -1, dtype=torch.int32)]
    fast = apply_masks(logits, masks)
    monkeypatch.setattr(grammar, "mask_fill_rows", lambda *_: False)  # as where the C kernel does not build
    slow = apply_masks(logits, masks)
    assert torch.equal(fast, slow) and fast.data_ptr() != logits.data_ptr()
    assert torch.isinf(fast[2]).all() and torch.equal(fast[1], logits[1]) and torch.equal(fast[3], logits[3])
    mine = logits.clone()
    assert apply_masks(mine, masks, in_place=True) is mine and torch.equal(mine, slow)


@pytest.fixture(scope="module")
def engine(tiny_chat_dir: Path) -> LLMEngine:
    return LLMEngine.from_pretrained(tiny_chat_dir, EngineConfig(dtype="float32", kv_format="fp32",
                                                                 kv_cache_bytes=16 * 2**20, max_num_seqs=32))


def _run(engine: LLMEngine) -> None:
    while engine.has_work():
        for out in engine.step():
            assert out.error is None, out.error


def test_every_output_validates_over_60_generated_schemas(engine: LLMEngine) -> None:
    tok = engine.tokenizer
    prompt = tok.encode("Reply in JSON.")
    seqs = []
    for i, schema in enumerate(schemas(60)):
        jsonschema.Draft202012Validator.check_schema(schema)
        for max_tokens in (64, 3):  # long enough to finish mostly; short enough to cut
            seqs.append((schema, engine.add_request(prompt, SamplingParams(
                max_tokens=max_tokens, temperature=1.0, seed=i, grammar=_spec(schema)))))
    _run(engine)
    finished = cut = 0
    for schema, s in seqs:
        text = tok.decode(s.output_ids)
        if s.finish_reason == "stop":
            jsonschema.validate(json.loads(text), schema)
            finished += 1
        else:  # cut by max_tokens: a prefix of a valid document, said so
            assert s.finish_reason == "length" and len(s.output_ids) == s.params.max_tokens
            cut += 1
    assert finished >= 50 and cut >= 30, (finished, cut)
    assert engine.stats["grammar_advances"] > 0


def test_json_object_and_free_rows_unaffected_in_the_same_batch(engine: LLMEngine) -> None:
    tok = engine.tokenizer
    prompt = tok.encode("Hello there")
    free = [SamplingParams(max_tokens=12, temperature=0.9, seed=s, ignore_eos=True) for s in (1, 2)]
    alone = [engine.add_request(prompt, p) for p in free]
    _run(engine)
    mixed = [engine.add_request(prompt, p) for p in free]
    objs = [engine.add_request(prompt, SamplingParams(max_tokens=40, temperature=1.0, seed=s,
                                                      grammar=GrammarSpec("json_object"))) for s in range(4)]
    _run(engine)
    assert [s.output_ids for s in mixed] == [s.output_ids for s in alone]
    for s in objs:
        if s.finish_reason == "stop":
            assert isinstance(json.loads(tok.decode(s.output_ids)), dict)
        else:
            assert s.finish_reason == "length" and tok.decode(s.output_ids).startswith("{")


def test_grammar_refuses_ignore_eos(engine: LLMEngine) -> None:
    with pytest.raises(InvalidSamplingParams) as info:
        engine.add_request([1, 2], SamplingParams(ignore_eos=True, grammar=GrammarSpec("json_object")))
    assert info.value.details["field"] == "ignore_eos"
    with pytest.raises(InvalidSamplingParams):
        engine.add_request([1, 2], SamplingParams(grammar=GrammarSpec("json_schema", '{"type": 3}')))
