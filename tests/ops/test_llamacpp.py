"""`ops.bench.llamacpp`: the build's command lines, cache, marker and lock, its typed errors, the F32 GGUF, the server.

The build tests run the real `ensure_llamacpp` against a small source distribution made
here and a stand-in `cmake` put first on PATH (a shell script: one that fails, one that
"builds" by writing the two binaries), so the marker, rename and clean-up logic runs
without compiling llama.cpp. The server test uses the real llama-server where it is built.
"""

from __future__ import annotations

import io
import os
import stat
import tarfile
import threading
import time
from pathlib import Path

import pytest

from ops.bench import llamacpp
from ops.bench.llamacpp import COMPLETE_MARKER, LlamaCppBuild, LlamaCppUnavailable

VERSION = "9.9.9"


def _script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _sdist(tmp_path: Path) -> Path:
    """A .tar.gz shaped like llama-cpp-python's: vendor/llama.cpp/ plus a .git/modules copy to ignore."""
    path = tmp_path / f"llama_cpp_python-{VERSION}.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for name in (f"llama_cpp_python-{VERSION}/.git/modules/vendor/llama.cpp/config",
                     f"llama_cpp_python-{VERSION}/vendor/llama.cpp/CMakeLists.txt",
                     f"llama_cpp_python-{VERSION}/llama_cpp/__init__.py"):
            data = b"project(llama.cpp)\n"
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _fake_cmake(bin_dir: Path, fail: bool = False) -> Path:
    """`cmake` that fails, or that configures (checks the source) and "builds" the two binaries."""
    bin_dir.mkdir(exist_ok=True)
    if fail:
        return _script(bin_dir / "cmake", "echo 'CMake Error: no C compiler could be found' >&2\nexit 1\n")
    return _script(bin_dir / "cmake", """
if [ "$1" = "-S" ]; then test -f "$2/CMakeLists.txt" || exit 3; mkdir -p "$4"; exit 0; fi
if [ "$1" = "--build" ]; then
  mkdir -p "$2/bin"
  for t in llama-server llama-quantize; do printf '#!/bin/sh\\necho %s\\n' $t > "$2/bin/$t"; chmod +x "$2/bin/$t"; done
  exit 0
fi
exit 2
""")


@pytest.fixture
def fake_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A bin folder first on PATH (with a C++ compiler found as usual, from the rest of PATH)."""
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return bin_dir


def test_configure_command_is_native_release_static_offline() -> None:
    argv = llamacpp.configure_command(Path("/src"), Path("/b"), "Ninja")
    assert argv[:5] == ["cmake", "-S", "/src", "-B", "/b"]
    for flag in ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF",
                 "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF"):
        assert flag in argv
    assert argv[-2:] == ["-G", "Ninja"]
    assert "-G" not in llamacpp.configure_command(Path("/src"), Path("/b"))


def test_build_command_builds_only_the_two_targets_with_one_job_per_core() -> None:
    argv = llamacpp.build_command(Path("/b"), 7)
    assert argv == ["cmake", "--build", "/b", "--config", "Release", "--target", "llama-server", "llama-quantize",
                    "-j", "7"]


def test_download_command_fetches_the_source_distribution_only() -> None:
    argv = llamacpp.download_command("0.3.36", Path("/d"))
    assert argv[1:4] == ["-m", "pip", "download"]
    assert {"--no-deps", "llama-cpp-python==0.3.36"} <= set(argv)
    assert argv[argv.index("--no-binary") + 1] == ":all:"


def test_server_command_slots_context_threads_port() -> None:
    argv = llamacpp.server_command(Path("/x/llama-server"), Path("/m.gguf"), 4321, slots=8, ctx_per_slot=256)
    assert argv[0] == "/x/llama-server"
    pairs = dict(zip(argv[1::2], argv[2::2]))
    assert (pairs["-m"], pairs["--port"], pairs["-t"], pairs["-np"], pairs["-c"]) == ("/m.gguf", "4321", "2", "8",
                                                                                       "2048")
    assert argv[-1] == "--no-webui"
    assert "--no-webui" not in llamacpp.server_command(Path("s"), Path("m"), 1, 1, 64, no_webui=False)


def test_a_folder_without_the_marker_is_not_a_build(tmp_path: Path) -> None:
    root = llamacpp.build_root(tmp_path) / VERSION
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "llama-server").write_text("half")
    assert llamacpp.installed_build(VERSION, tmp_path) is None
    (root / COMPLETE_MARKER).write_text("done")
    assert llamacpp.installed_build(VERSION, tmp_path) == LlamaCppBuild(VERSION, root)


def test_failing_cmake_raises_the_typed_error_and_leaves_nothing(tmp_path: Path, fake_path: Path) -> None:
    _fake_cmake(fake_path, fail=True)
    with pytest.raises(LlamaCppUnavailable, match="configure llama.cpp.*status 1(.|\n)*no C compiler"):
        llamacpp.ensure_llamacpp(VERSION, home=tmp_path, sdist=_sdist(tmp_path), log=lambda m: None)
    root = llamacpp.build_root(tmp_path)
    assert sorted(p.name for p in root.iterdir()) == [f".{VERSION}.lock"]  # no build, no temporary folder


def test_missing_tools_say_which(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(LlamaCppUnavailable, match="cmake and a C\\+\\+ compiler.*not found on PATH"):
        llamacpp.ensure_llamacpp(VERSION, home=tmp_path, sdist=_sdist(tmp_path), log=lambda m: None)


def test_build_replaces_a_half_build_marks_and_is_reused(tmp_path: Path, fake_path: Path) -> None:
    _fake_cmake(fake_path)
    root = llamacpp.build_root(tmp_path)
    half = root / VERSION / "bin"
    half.mkdir(parents=True)
    (half / "llama-server").write_text("from a crashed build")
    stale = root / f".{VERSION}.tmp-crashed"
    stale.mkdir()
    lines: list[str] = []
    build = llamacpp.ensure_llamacpp(VERSION, home=tmp_path, sdist=_sdist(tmp_path), jobs=3, log=lines.append)
    assert (build.root / COMPLETE_MARKER).is_file()
    assert build.server.read_text() == "#!/bin/sh\necho llama-server\n"
    assert build.quantize.is_file()
    assert sorted(p.name for p in build.root.iterdir()) == [COMPLETE_MARKER, "bin"]  # sources and objects gone
    assert not stale.exists()
    assert any("-j 3" in line for line in lines)  # progress: each step is printed
    assert llamacpp.ensure_llamacpp(VERSION, home=tmp_path, log=lines.append) == build  # no second build


def test_concurrent_builds_build_once(tmp_path: Path, fake_path: Path) -> None:
    _script(fake_path / "cmake", f"""sleep 0.3
if [ "$1" = "-S" ]; then mkdir -p "$4"; exit 0; fi
echo built >> {tmp_path}/calls
mkdir -p "$2/bin"; touch "$2/bin/llama-server" "$2/bin/llama-quantize"
""")
    sdist = _sdist(tmp_path)
    results: list[LlamaCppBuild] = []
    threads = [threading.Thread(target=lambda: results.append(
        llamacpp.ensure_llamacpp(VERSION, home=tmp_path, sdist=sdist, log=lambda m: None))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2 and results[0] == results[1]
    assert (tmp_path / "calls").read_text() == "built\n"


def test_f32_gguf_is_made_once_under_a_temporary_name(tmp_path: Path) -> None:
    root = tmp_path / "build"
    (root / "bin").mkdir(parents=True)
    calls = tmp_path / "calls"
    _script(root / "bin" / "llama-quantize", f"""echo "$*" >> {calls}
test "$1" = --allow-requantize && test "$4" = F32 || exit 9
case "$3" in *.tmp-*) ;; *) exit 8;; esac
cp "$2" "$3"
""")
    q4 = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    q4.write_bytes(b"GGUF q4")
    build = LlamaCppBuild(VERSION, root)
    f32 = llamacpp.f32_gguf(build, q4, tmp_path / "models", log=lambda m: None)
    assert f32 == tmp_path / "models" / "SmolLM2-135M-Instruct.F32.gguf"
    assert f32.read_bytes() == b"GGUF q4"
    assert llamacpp.f32_gguf(build, q4, tmp_path / "models", log=lambda m: None) == f32
    assert len(calls.read_text().splitlines()) == 1
    assert [p.name for p in f32.parent.iterdir() if ".tmp-" in p.name] == []


def test_failing_quantize_leaves_no_f32(tmp_path: Path) -> None:
    root = tmp_path / "build"
    (root / "bin").mkdir(parents=True)
    _script(root / "bin" / "llama-quantize", 'echo partial > "$3"; echo "unknown type" >&2; exit 1\n')
    q4 = tmp_path / "m.Q4_1.gguf"
    q4.write_bytes(b"x")
    with pytest.raises(LlamaCppUnavailable, match="unknown type"):
        llamacpp.f32_gguf(LlamaCppBuild(VERSION, root), q4, tmp_path / "models", log=lambda m: None)
    assert [p.name for p in (tmp_path / "models").iterdir() if not p.name.endswith(".lock")] == []


def test_real_llama_server_answers_and_its_group_is_killed(tmp_path: Path, smollm2_dir: Path) -> None:
    import asyncio

    from ops.bench.e2e import closed_loop, make_prompts
    from ops.pull import gguf_path

    build = llamacpp.installed_build()
    if build is None:
        pytest.skip(f"llama-server is not built here (ops.bench.llamacpp.ensure_llamacpp builds it into "
                    f"{llamacpp.build_root() / llamacpp.VERSION}, ~15 min); not built by tests")
    # passive OpenMP waiting: on a machine shared with other tests, spinning threads made decode ~1 s/token
    with llamacpp.llama_server(build, gguf_path("smollm2-135m"), slots=2, ctx_per_slot=256,
                               log_path=tmp_path / "llama.log", env={"OMP_WAIT_POLICY": "PASSIVE"}) as server:
        pid = server.pid
        replies, errors, wall = asyncio.run(closed_loop(f"{server.url}/v1/chat/completions", {},
                                                        make_prompts("t", 3), 2, 12))
    assert errors == {} and len(replies) == 3 and wall > 0
    assert all(0 < r.completion_tokens <= 12 and r.prompt_tokens > 50 for r in replies)
    assert all(r.ms_per_token is not None and r.ms_per_token > 0 for r in replies)  # its `timings`
    time.sleep(0.1)
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)  # the whole group is gone


_FAKE_SERVER = """#!/bin/sh
# llama-server stand-in: lists its flags; crashes like an AMX fault unless --no-repack; else answers /health
case "$*" in *--help*) echo "--no-webui  --no-repack"; exit 0;; esac
echo "$*" >> "$(dirname "$0")/starts"
case "$*" in *--no-repack*) ;; *) kill -SEGV $$;; esac
port=$(echo "$*" | sed 's/.*--port \\([0-9]*\\).*/\\1/')
exec "{python}" -c "
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b'ok')
http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()
" "$port"
"""


def test_a_server_crashing_at_load_is_started_again_without_repacking(tmp_path: Path) -> None:
    import sys

    import httpx

    root = tmp_path / "build"
    (root / "bin").mkdir(parents=True)
    _script(root / "bin" / "llama-server", _FAKE_SERVER.replace("#!/bin/sh\n", "").replace("{python}", sys.executable))
    lines: list[str] = []
    with llamacpp.llama_server(LlamaCppBuild(VERSION, root), tmp_path / "m.gguf", 2, 128, tmp_path / "l.log",
                               log=lines.append) as server:
        assert httpx.get(f"{server.url}/health").status_code == 200
        assert server.argv[-2:] == ["--no-webui", "--no-repack"]
    starts = (root / "bin" / "starts").read_text().splitlines()
    assert len(starts) == 2 and "--no-repack" not in starts[0]
    assert "signal 11" in lines[0]
    with pytest.raises(ProcessLookupError):
        os.killpg(server.pid, 0)


def test_the_server_dies_with_a_killed_parent(tmp_path: Path) -> None:
    import subprocess
    import sys

    root = tmp_path / "build"
    (root / "bin").mkdir(parents=True)
    _script(root / "bin" / "llama-server", _FAKE_SERVER.replace("#!/bin/sh\n", "").replace("{python}", sys.executable))
    code = (f"from pathlib import Path; from ops.bench import llamacpp\n"
            f"b = llamacpp.LlamaCppBuild('x', Path({str(root)!r}))\n"
            f"with llamacpp.llama_server(b, Path('m'), 1, 64, Path({str(tmp_path / 'l.log')!r}), log=print) as s:\n"
            f"    print(s.pid, flush=True); import time; time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    pid = 0
    for line in parent.stdout:
        if line.strip().isdigit():
            pid = int(line)
            break
    parent.kill()  # SIGKILL: no finally runs in the parent
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.killpg(pid, 9)
        pytest.fail("llama-server outlived its parent")
