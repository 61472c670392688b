"""Paged decode attention on the CPU without gathering the context (C, built on first use).

The torch path of `backend/attention.py` gathers every decoding sequence's pages into a
contiguous [D, L, kv_heads, head_dim] copy in the compute dtype, then runs SDPA: for
FP8 pages that copy is also a dequantisation (a table lookup and a scale multiply over
the whole context, per layer, per step), which made FP8 pages slower than BF16 ones
at equal concurrency on this CPU. `kernels/cpu/paged_decode.c` instead walks each
(sequence, KV head)'s pages in place: one page row at a time is converted to float32
into a buffer that stays in L1 (fp8: bit placement plus two exact power-of-two
multiplies, no table; bf16: a shift), dotted with the G query heads of that KV head,
and folded into an online softmax (blocks of 32 tokens); values the same way. The
bytes read are the pool's own: half of BF16's for FP8.

Numerics: float32 throughout, like the torch path with compute dtype float32; the
dequantised values are bit-identical to `kernels.kv_store.dequantize_fp8_ref`, and the
result differs from the gather + SDPA reference only by summation order (tests compare
within 1e-5 relative on fresh random inputs).

Build: `gcc -O3 -march=native` (vector units of the host it runs on: CPU defaults follow
the machine, not one host's results) plus the reassociation flags that let the compiler
vectorise float sums (`-fassociative-math -fno-signed-zeros -fno-trapping-math`, not
`-ffast-math`: no flush-to-zero). The shared object is cached under
`$EDGESERVE_HOME/kernels/` keyed by the source, flags, compiler and CPU flags, so a
source change or another host rebuilds it. Without a C compiler (or when the build
fails) `available()` is False, the reason is logged once, and the torch path runs.
Threads: pthreads over (sequence, KV head) pairs, `torch.get_num_threads()` of them
when the step's context is large enough to pay for starting them.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import threading
from pathlib import Path

import torch

__all__ = ["available", "paged_decode_attention_cpu", "build_error"]

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu") / "paged_decode.c"
_FLAGS = ["-O3", "-march=native", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math",
          "-fno-math-errno", "-fPIC", "-shared", "-pthread"]
_FORMATS = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2}
_THREADED_ROWS = 4096  # (sequence, KV head, token) rows below which one thread does the whole step
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_error: str | None = None


def _cache_dir() -> Path:
    home = os.environ.get("EDGESERVE_HOME")
    return (Path(home).expanduser() if home else Path.home() / ".cache" / "edgeserve") / "kernels"


def _cpu_key() -> str:
    try:
        return next(x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("flags"))
    except (OSError, StopIteration):
        return os.uname().machine


def _build() -> ctypes.CDLL:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise OSError("no C compiler (gcc or cc) on PATH")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256("\0".join([_SOURCE.read_text(), *_FLAGS, version, _cpu_key()]).encode()).hexdigest()[:16]
    out = _cache_dir() / f"paged_decode-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        res = subprocess.run([cc, *_FLAGS, str(_SOURCE), "-o", str(tmp), "-lm"], capture_output=True, text=True,
                             check=False)
        if res.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise OSError(f"{cc} failed: {res.stderr.strip()[:500]}")
        os.replace(tmp, out)  # atomic: concurrent builders each write their own file
    lib = ctypes.CDLL(str(out))
    p = ctypes.c_void_p
    i = ctypes.c_int
    lib.paged_decode.argtypes = [p, p, p, p, p, p, p, p, i, i, i, i, i, i, i, ctypes.c_float, i]
    lib.paged_decode.restype = ctypes.c_int
    return lib


def _load() -> ctypes.CDLL | None:
    global _lib, _error
    with _lock:
        if _lib is None and _error is None:
            try:
                _lib = _build()
            except OSError as exc:
                _error = str(exc)
                log.warning("CPU paged decode kernel unavailable (%s); decode attention gathers pages instead", exc)
        return _lib


def available() -> bool:
    """Whether the C kernel is built and loaded (builds it on the first call)."""
    return _load() is not None


def build_error() -> str | None:
    """Why the kernel is unavailable, or None."""
    _load()
    return _error


def paged_decode_attention_cpu(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                               k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                               page_table: torch.Tensor, context_lens: torch.Tensor, scale: float,
                               threads: int | None = None) -> torch.Tensor | None:
    """Decode attention [D, heads, head_dim] (float32) for q [D, heads, head_dim] over pages
    [P, PAGE_SIZE, kv_heads, head_dim] (fp32, bf16, or fp8_e4m3 with exponents [P, PAGE_SIZE, kv_heads]),
    page_table [D, maxP] and context_lens [D] (each >= 1). None when the kernel cannot run this
    case (not built, another dtype, a head_dim over 256): the caller takes the torch path."""
    lib = _load()
    fmt = _FORMATS.get(k_pages.dtype)
    d, heads, hd = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    if lib is None or fmt is None or k_pages.is_cuda or not (k_pages.is_contiguous() and v_pages.is_contiguous()):
        return None
    group = heads // kv_heads
    qf = q.to(torch.float32).contiguous()
    table = page_table.to(torch.int64).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    if fmt == 2:
        k_scale, v_scale = k_scale.contiguous(), v_scale.contiguous()
    out = torch.empty(d, heads, hd, dtype=torch.float32)
    if threads is None:
        threads = torch.get_num_threads() if int(lens.sum()) * kv_heads >= _THREADED_ROWS else 1
    rc = lib.paged_decode(qf.data_ptr(), k_pages.data_ptr(), v_pages.data_ptr(),
                          k_scale.data_ptr() if fmt == 2 else None, v_scale.data_ptr() if fmt == 2 else None,
                          table.data_ptr(), lens.data_ptr(), out.data_ptr(), d, kv_heads, group, hd, page_size,
                          table.shape[1], fmt, scale, threads)
    return out if rc == 0 else None
