"""llama.cpp's `llama-server` as a comparator: built once from source, its GGUF files, started and stopped.

llama.cpp is the server a CPU user would otherwise pick, so the end-to-end benchmark
(`ops.bench.e2e`) measures edgeserve against it through the same OpenAI endpoint.
There is no prebuilt binary we may fetch (the registries we reach are PyPI, npm and
Debian), so it is compiled here from the source distribution of `llama-cpp-python`
(pinned `VERSION`), whose `vendor/llama.cpp/` is the whole of llama.cpp:

1. `pip download --no-binary :all: --no-deps llama-cpp-python==VERSION` into a
   temporary folder `<home>/llamacpp/.VERSION.tmp-*`, and extract `vendor/llama.cpp/`;
2. configure with CMake (`configure_command`: Release, native CPU, static, no curl, no
   OpenSSL, no web UI assets: the default would download them) and build only the
   targets `llama-server` and `llama-quantize` with one job per core, showing the
   compiler's progress;
3. copy the two binaries into the temporary folder's `bin/`, write the
   `.edgeserve-complete` marker last, delete the sources and objects, and rename the
   folder to `<home>/llamacpp/VERSION/`.

As in `ops.pull`: a folder without the marker is never used, the rename is atomic, and a
lock file serialises concurrent builds, so a crash leaves only a temporary folder (removed
by the next build) and never a half-built binary in use. A second call is a stat.
Where the build cannot run (no cmake or C++ compiler, pip refused, a compile error)
`LlamaCppUnavailable` says why; callers print it and skip the comparator.

GGUF files (`model_ggufs`): Q4_1 is the file `edgeserve pull` keeps for SmolLM2-135M
(Q4_1 blocks, an 8-bit token embedding); F32 and BF16 are `llama-quantize --allow-requantize
<q4_1> <out> F32|BF16`: the file's dequantised values, and the same rounded to nearest-even
BF16 as `edgeserve pull` rounds ours (so the BF16 file holds our weights' numbers), made once
into `<home>/llamacpp/models/` (written under a temporary name and renamed).

`llama_server` runs `llama-server -m GGUF -t THREADS -np SLOTS -c SLOTS*CTX` on a free
loopback port, without its web UI where the build has the flag, in its own process
group; it waits for `/health` and kills the whole group on exit. A server killed by a signal while
loading is started once more with `--no-repack` (no AMX or repacked weight buffers): some VMs report
AMX but fault on its tile instructions.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

from ops.parent_death import own_group_dying_with_parent

__all__ = ["VERSION", "COMPLETE_MARKER", "LlamaCppUnavailable", "LlamaCppBuild", "build_root", "installed_build",
           "ensure_llamacpp", "download_command", "configure_command", "build_command", "model_ggufs", "f32_gguf",
           "server_command", "LlamaServer", "llama_server"]

VERSION = "0.3.36"  # llama-cpp-python on PyPI; its vendor/llama.cpp is what we build
COMPLETE_MARKER = ".edgeserve-complete"
TARGETS = ("llama-server", "llama-quantize")

Log = Callable[[str], None]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class LlamaCppUnavailable(RuntimeError):
    """llama.cpp's server cannot be built or started on this machine; the message says why."""


class LlamaCppBuild(NamedTuple):
    """A complete build: `root` holds `bin/llama-server` and `bin/llama-quantize`."""

    version: str
    root: Path

    @property
    def server(self) -> Path:
        return self.root / "bin" / "llama-server"

    @property
    def quantize(self) -> Path:
        return self.root / "bin" / "llama-quantize"


def build_root(home: Path | None = None) -> Path:
    """`<home>/llamacpp/` (home as for models: `$EDGESERVE_HOME`, else ~/.cache/edgeserve)."""
    from ops.pull import edgeserve_home

    return (home if home is not None else edgeserve_home()) / "llamacpp"


def installed_build(version: str = VERSION, home: Path | None = None) -> LlamaCppBuild | None:
    """The complete build of `version`, or None (never built, or only a folder without the marker)."""
    root = build_root(home) / version
    return LlamaCppBuild(version, root) if (root / COMPLETE_MARKER).is_file() else None


# ---------------------------------------------------------------- the build's commands

def download_command(version: str, dest: Path) -> list[str]:
    """pip fetching the source distribution (never a wheel, never its dependencies) into `dest`."""
    return [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "--no-input",
            f"llama-cpp-python=={version}", "-d", str(dest)]


def configure_command(source: Path, build: Path, generator: str | None = None) -> list[str]:
    """CMake's configure step: Release, tuned to this CPU (`GGML_NATIVE`), static binaries (they move
    after the build), and nothing that reaches the network at build or run time."""
    argv = ["cmake", "-S", str(source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
            "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF"]
    return argv + (["-G", generator] if generator else [])


def build_command(build: Path, jobs: int) -> list[str]:
    """CMake's build step for the two targets only, `jobs` compilers at once."""
    return ["cmake", "--build", str(build), "--config", "Release", "--target", *TARGETS, "-j", str(jobs)]


def _run_step(argv: list[str], what: str, log: Log, cwd: Path | None = None) -> None:
    """Run one build step with its output on our stderr (progress); a failure or a missing tool raises
    `LlamaCppUnavailable` naming the step and the last lines it printed."""
    log(f"llama.cpp: {what}: {' '.join(argv)}")
    tail: list[str] = []
    try:
        proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace")
    except OSError as exc:
        raise LlamaCppUnavailable(f"cannot {what}: {argv[0]} did not start ({exc})") from exc
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stderr.write(line)
        tail = (tail + [line.rstrip()])[-15:]
    if proc.wait() != 0:
        raise LlamaCppUnavailable(f"cannot {what}: `{' '.join(argv[:3])} ...` exited with status {proc.returncode}; "
                                  "it printed last:\n" + "\n".join(tail))


def _check_tools() -> None:
    missing = [t for t in ("cmake",) if shutil.which(t) is None]
    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        missing.append("a C++ compiler (c++, g++ or clang++)")
    if missing:
        raise LlamaCppUnavailable(f"cannot build llama.cpp: {' and '.join(missing)} not found on PATH")


@contextlib.contextmanager
def _locked(lock_file: Path) -> Iterator[None]:
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with lock_file.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _extract_llama_cpp(sdist: Path, into: Path) -> Path:
    """Extract the sdist's `vendor/llama.cpp/` under `into`; its path."""
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.partition("/")[2].startswith("vendor/llama.cpp/")]
        if not members:
            raise LlamaCppUnavailable(f"{sdist.name} has no vendor/llama.cpp/")
        tar.extractall(into, members=members, filter="data")
    return into / members[0].name.partition("/")[0] / "vendor" / "llama.cpp"


def ensure_llamacpp(version: str = VERSION, home: Path | None = None, jobs: int | None = None,
                    log: Log = _stderr, sdist: Path | None = None) -> LlamaCppBuild:
    """The build of `version`, made first if needed (module docstring); instant when it exists.
    `sdist`: build from this source distribution (a .tar.gz of `version`) instead of downloading it.
    Raises `LlamaCppUnavailable` where it cannot be built."""
    found = installed_build(version, home)
    if found is not None:
        return found
    root = build_root(home)
    with _locked(root / f".{version}.lock"):
        found = installed_build(version, home)  # built by whoever held the lock before us
        if found is not None:
            return found
        _check_tools()
        dest = root / version
        if dest.exists():  # a folder without the marker: never used, never kept
            shutil.rmtree(dest)
        for stale in root.glob(f".{version}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{version}.tmp-", dir=root))
        try:
            started = time.monotonic()
            if sdist is None:
                _run_step(download_command(version, tmp / "sdist"), f"download llama-cpp-python {version}", log)
            sdists = [sdist] if sdist is not None else sorted((tmp / "sdist").glob("*.tar.gz"))
            if not sdists:
                raise LlamaCppUnavailable(f"pip downloaded no source distribution of llama-cpp-python {version}")
            source = _extract_llama_cpp(sdists[0], tmp / "src")
            jobs = jobs or len(os.sched_getaffinity(0))
            generator = "Ninja" if shutil.which("ninja") else None
            _run_step(configure_command(source, tmp / "build", generator), "configure llama.cpp", log)
            _run_step(build_command(tmp / "build", jobs), f"build {' and '.join(TARGETS)} ({jobs} jobs)", log)
            (tmp / "bin").mkdir()
            for target in TARGETS:
                built = next((p for p in (tmp / "build" / "bin" / target, tmp / "build" / target) if p.is_file()),
                             None)
                if built is None:
                    raise LlamaCppUnavailable(f"the build finished without a {target} binary")
                shutil.copy2(built, tmp / "bin" / target)
            shutil.rmtree(tmp / "src")
            shutil.rmtree(tmp / "build")
            shutil.rmtree(tmp / "sdist", ignore_errors=True)
            (tmp / COMPLETE_MARKER).write_text(f"llama-cpp-python {version}\n")
            tmp.chmod(0o755)  # mkdtemp made it private; the build is for every user of this home
            tmp.rename(dest)
            log(f"llama.cpp: built {', '.join(TARGETS)} into {dest / 'bin'} in {time.monotonic() - started:.0f} s")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return LlamaCppBuild(version, dest)


# ---------------------------------------------------------------- GGUF files

def model_ggufs(build: LlamaCppBuild, model: str = "smollm2-135m", home: Path | None = None,
                log: Log = _stderr) -> dict[str, Path]:
    """{"q4_1": the pulled GGUF, "f32" / "bf16": its F32 and BF16 requantisations (made once, cached)} for
    `model`. F32 holds the Q4_1 blocks' dequantised values; BF16 rounds them to nearest-even, as `edgeserve
    pull` does for our weights, so the BF16 file and our weights hold the same numbers."""
    from ops.pull import gguf_path, resolve_model

    resolve_model(model, home=home)  # pulled once (the GGUF is kept beside the converted folder)
    q4 = gguf_path(model, home=home)
    if not q4.is_file():
        raise LlamaCppUnavailable(f"{q4} is missing: pull {model} again (`edgeserve pull {model}`)")
    models = build_root(home) / "models"
    return {"q4_1": q4, "f32": f32_gguf(build, q4, models, log), "bf16": f32_gguf(build, q4, models, log, "BF16")}


def f32_gguf(build: LlamaCppBuild, q4: Path, dest_dir: Path, log: Log = _stderr, ftype: str = "F32") -> Path:
    """`dest_dir/<name>.<ftype>.gguf`: `q4` requantised to `ftype` (F32, or BF16) by llama-quantize, made once
    (under a temporary name, renamed when complete)."""
    f32 = dest_dir / f"{q4.name.removesuffix('.gguf').removesuffix('.Q4_1')}.{ftype}.gguf"
    if not f32.is_file():
        with _locked(f32.parent / f".{f32.name}.lock"):
            if not f32.is_file():
                tmp = f32.with_name(f".{f32.name}.tmp-{os.getpid()}")
                try:
                    _run_step([str(build.quantize), "--allow-requantize", str(q4), str(tmp), ftype],
                              f"make {f32.name}", log)
                    tmp.rename(f32)
                finally:
                    tmp.unlink(missing_ok=True)
    return f32


# ---------------------------------------------------------------- the server

def _has_flag(binary: Path, flag: str) -> bool:
    """Whether `binary --help` lists `flag`."""
    try:
        out = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=30, errors="replace")
    except (OSError, subprocess.SubprocessError):
        return False
    return flag in out.stdout + out.stderr


def server_command(server: Path, gguf: Path, port: int, slots: int, ctx_per_slot: int, threads: int = 2,
                   no_webui: bool = True) -> list[str]:
    """llama-server on 127.0.0.1:`port`: `slots` parallel sequences of `ctx_per_slot` tokens each
    (continuous batching, its default), `threads` threads for decode and prompt batches."""
    argv = [str(server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
            "-tb", str(threads), "-np", str(slots), "-c", str(slots * ctx_per_slot)]
    return argv + (["--no-webui"] if no_webui else [])


class LlamaServer(NamedTuple):
    """A running llama-server."""

    url: str  # http://127.0.0.1:PORT
    pid: int
    argv: list[str]


def _kill_group(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGTERM the child's process group, SIGKILL it after `timeout_s`; reap the child."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=timeout_s)
            return
        except subprocess.TimeoutExpired:
            continue
    proc.wait()


def _start(argv: list[str], log_path: Path, timeout_s: float, env: dict[str, str] | None) -> subprocess.Popen:
    """Start `argv` in its own process group and wait for its `/health`; on failure the group is killed
    and `LlamaCppUnavailable` raised, with the exit status (`.returncode`) and the log's tail."""
    import httpx

    from ops.cluster import log_tail

    url = f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                preexec_fn=own_group_dying_with_parent)
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc
        time.sleep(0.2)
    status = proc.poll()  # None: still running, not ready in time
    _kill_group(proc)
    state = f"exited with status {status}" if status is not None else f"not ready in {timeout_s:.0f} s"
    message = f"llama-server {state}; its log ends:\n{log_tail(log_path)}"
    raise _Crashed(message, -status) if status is not None and status < 0 else LlamaCppUnavailable(message)


class _Crashed(LlamaCppUnavailable):
    """llama-server was killed by signal `signum` while starting."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum


@contextlib.contextmanager
def llama_server(build: LlamaCppBuild, gguf: Path, slots: int, ctx_per_slot: int, log_path: Path,
                 threads: int = 2, timeout_s: float = 120.0, log: Log = _stderr,
                 env: dict[str, str] | None = None) -> Iterator[LlamaServer]:
    """Run llama-server (`server_command`, environment ours + `env`) until the context exits; ready
    (`/health` 200) when yielded.

    Killed by a signal while loading (its warm-up runs the kernels once), it is started again with
    `--no-repack`, which leaves out the repacked and AMX weight buffers: on a host whose CPU reports AMX
    but whose hypervisor faults on tile instructions (seen on a Firecracker VM: SIGSEGV in
    `ggml_backend_amx_mul_mat`), that is the build's fastest path that runs; `LlamaServer.argv` says
    which ran. Raises `LlamaCppUnavailable` with its log's tail when it cannot start."""
    from ops.redis_server import free_port

    argv = server_command(build.server, gguf, free_port(), slots, ctx_per_slot, threads,
                          no_webui=_has_flag(build.server, "--no-webui"))
    log_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        proc = _start(argv, log_path, timeout_s, env)
    except _Crashed as exc:
        if not _has_flag(build.server, "--no-repack"):
            raise
        log(f"llama-server died with signal {exc.signum} while loading {gguf.name} (its repacked/AMX kernels on "
            "this host); starting it again with --no-repack")
        argv = [*argv, "--no-repack"]
        proc = _start(argv, log_path, timeout_s, env)
    try:
        yield LlamaServer(f"http://127.0.0.1:{argv[argv.index('--port') + 1]}", proc.pid, argv)
    finally:
        _kill_group(proc)
