"""Detokenised text with stop strings trimmed, whatever the token boundaries."""

from __future__ import annotations

import random

import pytest

from backend.tokenizer import Tokenizer
from gateway.text_stream import TextStream


@pytest.fixture(scope="module")
def tok(smollm2_dir) -> Tokenizer:
    return Tokenizer.from_model_dir(smollm2_dir)


TEXT = "The river Thames flows east — through London 🌊 and out to the North Sea. Ça va? END of story."


def stream_text(tok: Tokenizer, ids: list[int], stops: list[str], seed: int) -> tuple[str, bool]:
    """Push ids in random-sized groups, as worker events arrive; return all released text."""
    rng = random.Random(seed)
    ts, out, i = TextStream(tok, stop=stops), [], 0
    while i < len(ids):
        n = rng.randint(1, 4)
        out.append(ts.push(ids[i:i + n]))
        i += n
    out.append(ts.finish())
    return "".join(out), ts.stopped


@pytest.mark.parametrize("seed", range(4))
def test_without_stops_the_text_is_the_whole_decode(tok: Tokenizer, seed: int) -> None:
    ids = tok.encode(TEXT)
    assert stream_text(tok, ids, [], seed) == (tok.decode(ids), False)


@pytest.mark.parametrize("stop", ["London", "🌊", "Ça", "END", "e", "North Sea. Ça"])
@pytest.mark.parametrize("seed", range(3))
def test_text_stops_right_before_the_first_stop_string(tok: Tokenizer, stop: str, seed: int) -> None:
    ids = tok.encode(TEXT)
    full = tok.decode(ids)
    text, stopped = stream_text(tok, ids, ["never-there", stop], seed)
    assert stopped and text == full[: full.find(stop)]


def test_text_that_only_looks_like_a_stop_prefix_is_released_at_the_end(tok: Tokenizer) -> None:
    ids = tok.encode("flows to the Nor")
    text, stopped = stream_text(tok, ids, ["North Sea"], 0)
    assert not stopped and text == tok.decode(ids)


PROMPT = "A question about rivers, asked in the prompt:"


@pytest.mark.parametrize("stop", [None, "London", "🌊", "Ça", "e", "never-there"])
@pytest.mark.parametrize("seed", range(3))
def test_whole_mode_gives_the_incremental_text(tok: Tokenizer, stop: str | None, seed: int) -> None:
    """A non-streamed response decodes once at the end: same text, stop strings cut the same way,
    with the prompt's last ids as left context (whose own text is never returned)."""
    rng = random.Random(seed)
    words = TEXT.split(" ")
    text = " ".join(rng.sample(words, len(words)))  # fresh token boundaries each seed
    prompt_ids, ids = tok.encode(PROMPT), tok.encode(text)
    stops = [stop] if stop else []
    results = []
    for incremental in (True, False):
        ts, out, i = TextStream(tok, prompt_ids, stops, incremental=incremental), [], 0
        while i < len(ids):
            n = rng.randint(1, 4)
            out.append(ts.push(ids[i:i + n]))
            i += n
        out.append(ts.finish())
        results.append(("".join(out), ts.stopped, out[:-1]))
    (streamed, stopped, _), (whole, whole_stopped, early) = results
    assert (whole, whole_stopped) == (streamed, stopped)
    assert not any(early)  # nothing before the end
    full = tok.decode(prompt_ids + ids)[len(tok.decode(prompt_ids)):]
    assert whole == (full[: full.find(stop)] if stop and stop in full else full)
