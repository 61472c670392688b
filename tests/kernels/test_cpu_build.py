"""`CKernel` builds a C source once per host and content: a change to the source or to a header beside it
(what the kernels share, `kernels/cpu/bits.h`) builds a new shared object, an unchanged one loads the cached
build; a source that does not compile leaves the kernel unavailable with the compiler's reason."""

from __future__ import annotations

import ctypes
import logging
import shutil
from pathlib import Path

import pytest

from kernels.cpu_build import CKernel

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None, reason="no C compiler")


def _declare(lib: ctypes.CDLL) -> None:
    lib.answer.argtypes, lib.answer.restype = [], ctypes.c_int


def _kernel(src: Path) -> CKernel:
    k = CKernel("unused.c", (), _declare, "nothing")
    k.source = src
    return k


def test_a_header_change_rebuilds_and_an_unchanged_tree_reuses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGESERVE_HOME", str(tmp_path / "home"))
    cpu = tmp_path / "cpu"
    cpu.mkdir()
    (cpu / "value.h").write_text("#define VALUE 41\n")
    (cpu / "k.c").write_text('#include "value.h"\nint answer(void) { return VALUE + 1; }\n')
    assert _kernel(cpu / "k.c").load().answer() == 42
    built = sorted((tmp_path / "home" / "kernels").glob("k-*.so"))
    assert len(built) == 1
    assert _kernel(cpu / "k.c").load().answer() == 42  # the same content: the cached build
    assert sorted((tmp_path / "home" / "kernels").glob("k-*.so")) == built
    (cpu / "value.h").write_text("#define VALUE 99\n")
    assert _kernel(cpu / "k.c").load().answer() == 100  # the header changed: a new build
    assert len(list((tmp_path / "home" / "kernels").glob("k-*.so"))) == 2


def test_a_build_that_fails_leaves_the_kernel_unavailable_with_the_reason(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("EDGESERVE_HOME", str(tmp_path / "home"))
    (tmp_path / "bad.c").write_text("int answer(void) { return nope; }\n")
    k = _kernel(tmp_path / "bad.c")
    with caplog.at_level(logging.INFO, logger="kernels.cpu_build"):
        assert k.load() is None and "nope" in k.error
        # a source refusing this CPU by its own #error is expected there: info, not a warning (quiet by default)
        (tmp_path / "needs.c").write_text('#error "needs a CPU feature this one lacks"\n')
        assert _kernel(tmp_path / "needs.c").load() is None
    assert [(r.levelname, "nope" in r.getMessage()) for r in caplog.records] == [("WARNING", True), ("INFO", False)]


def test_every_kernel_of_the_tree_builds_here() -> None:
    """With a C compiler every C kernel of the tree builds and loads (a kernel whose build fails falls back to
    torch and its tests skip, so a compile error, e.g. two kernels' names colliding in a shared header, would
    otherwise pass unseen). The kernels that need a CPU feature are asked only where the CPU has it."""
    import importlib

    from backend.cpu_features import cpu_flags

    names = ["cpu_argmax", "cpu_kv_store", "cpu_paged_attention", "cpu_rms_norm", "cpu_rope", "cpu_silu_mul"]
    if "avx512_bf16" in cpu_flags() or {"avx2", "fma"} <= cpu_flags():
        names += ["cpu_gemv", "cpu_gemv_int4", "cpu_decode_layers"]  # the last calls both (AVX2 has copies)
    for name in names:
        module = importlib.import_module(f"kernels.{name}")
        assert module.available(), f"{name}: {module.build_error()}"
