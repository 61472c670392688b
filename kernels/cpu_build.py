"""Build a C kernel from `kernels/cpu/` for this host on first use, and load it with ctypes.

`gcc -O3 -march=native` (the vector units of the host it runs on: CPU defaults follow the
machine, not one host's results) plus each kernel's own flags. The shared object is cached
under `$EDGESERVE_HOME/kernels/` keyed by the source, the shared headers (`cpu/*.h`), flags,
compiler and CPU flags, so a source or header change or another host rebuilds it; it is
written under a temporary name and renamed, so concurrent builders never load a half-written
file. Without a C compiler, or when the build fails (e.g. a kernel that needs an instruction
set this CPU lacks), `load()` returns None, the reason is logged once (a warning; info where the
source's own `#error` says this CPU lacks what it needs) and kept in `error`, and callers take their
torch path.

Threads: a kernel built with `uses_pool=True` gets the process's one pool of helper threads
(`kernels/cpu/pool.c`, itself built here) through its `set_pool` at load time, so every such
kernel of a decode step shares the same helpers; where the pool cannot be built the kernel runs
each call on its caller's thread. Such a kernel is also built with `-fopenmp` (where the compiler
can), so that a call may run its chunks on torch's OpenMP pool instead (`kernels/cpu/pool.h`'s
`run_chunks`, `kernels/cpu_threads.py`'s `run_mode`): `libgomp.so.1` resolves to the copy torch has
loaded. Where `-fopenmp` does not build, the kernel is built without it and runs every call on the pool.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

__all__ = ["CKernel", "BASE_FLAGS", "POOL"]

log = logging.getLogger(__name__)

BASE_FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-pthread")


def _cache_dir() -> Path:
    home = os.environ.get("EDGESERVE_HOME")
    return (Path(home).expanduser() if home else Path.home() / ".cache" / "edgeserve") / "kernels"


def _cpu_key() -> str:
    try:
        return next(x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("flags"))
    except (OSError, StopIteration):
        return os.uname().machine


class CKernel:
    """One C source in `kernels/cpu/`, built once per host and loaded lazily (thread-safe)."""

    def __init__(self, source: str, flags: tuple[str, ...], declare: Callable[[ctypes.CDLL], None],
                 fallback: str, uses_pool: bool = False) -> None:
        self.source = Path(__file__).with_name("cpu") / source
        self.flags = (*BASE_FLAGS, *flags)
        self.declare = declare  # sets argtypes/restype of the functions the caller uses
        self.fallback = fallback  # what runs instead, for the one log line
        self.uses_pool = uses_pool  # the kernel has `set_pool(pool_run)`: hand it the shared pool on load
        self.error: str | None = None
        self._lib: ctypes.CDLL | None = None
        self._lock = threading.Lock()

    def _build(self) -> ctypes.CDLL:
        cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
        if cc is None:
            raise OSError("no C compiler (gcc or cc) on PATH")
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
        headers = [h.read_text() for h in sorted(self.source.parent.glob("*.h"))]  # what the sources include
        tries = [(*self.flags, "-fopenmp"), self.flags] if self.uses_pool else [self.flags]
        for i, flags in enumerate(tries):
            key = hashlib.sha256("\0".join([self.source.read_text(), *headers, *flags, version, _cpu_key()]).encode())
            out = _cache_dir() / f"{self.source.stem}-{key.hexdigest()[:16]}.so"
            if out.exists():
                break
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_suffix(f".{os.getpid()}.tmp")
            res = subprocess.run([cc, *flags, str(self.source), "-o", str(tmp), "-lm"], capture_output=True,
                                 text=True, check=False)
            if res.returncode == 0:
                os.replace(tmp, out)  # atomic: concurrent builders each write their own file
                break
            tmp.unlink(missing_ok=True)
            if i + 1 == len(tries):
                raise OSError(f"{cc} failed: {res.stderr.strip()[:500]}")
        lib = ctypes.CDLL(str(out))
        self.declare(lib)
        if self.uses_pool:
            pool = POOL.load()
            lib.set_pool.argtypes, lib.set_pool.restype = [ctypes.c_void_p], None
            lib.set_pool(ctypes.cast(pool.pool_run, ctypes.c_void_p) if pool is not None else None)
        return lib

    def available(self) -> bool:
        """Whether the kernel is built and loaded for this host (builds it on the first call)."""
        return self.load() is not None

    def build_error(self) -> str | None:
        """Why the kernel is unavailable (after trying to load it), or None."""
        self.load()
        return self.error

    def load(self) -> ctypes.CDLL | None:
        """The loaded library (built on the first call), or None where it cannot be built."""
        lib = self._lib  # loaded: no lock (every kernel call of a step asks; set once, after the build)
        if lib is not None:
            return lib
        with self._lock:
            if self._lib is None and self.error is None:
                try:
                    self._lib = self._build()
                except OSError as exc:
                    self.error = str(exc)
                    # a source's own `#error` says this CPU lacks what it needs: expected on such hosts, so not
                    # a warning (quiet by default); any other failure (no compiler, a broken build) is one
                    level = logging.INFO if "#error" in self.error else logging.WARNING
                    log.log(level, "CPU kernel %s unavailable (%s); %s", self.source.name, exc, self.fallback)
            return self._lib

    def address(self, symbol: str) -> int | None:
        """The address of the loaded kernel's function `symbol` (for C code that calls it: the fused decode
        layers, `cpu_decode_layers`), or None where the kernel is unavailable."""
        lib = self.load()
        return None if lib is None else ctypes.cast(getattr(lib, symbol), ctypes.c_void_p).value


def _declare_pool(lib: ctypes.CDLL) -> None:
    lib.pool_run.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.pool_run.restype = ctypes.c_int


POOL = CKernel("pool.c", (), _declare_pool, "the CPU kernels run each call on one thread")
"""The helper threads the CPU kernels share (loaded by the first kernel that uses it)."""
