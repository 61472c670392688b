"""The state of this shared machine around a run: load average, memory available, uptime.

Other people's processes share these cores, so a benchmark records how loaded the machine
was before and after (and refuses, or waits, when too little memory is free to start its
workers without the kernel's OOM killer picking a process). CPU model and flags are
`ops.cluster.machine_info`'s; `measure_machine` measures what the engine benchmarks compare
against (read bandwidth, GEMM rates).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["load_average", "load_average_text", "mem_available_gib", "uptime", "measure_machine"]


def load_average(ndigits: int | None = None) -> list[float]:
    """The 1, 5 and 15 minute load averages (rounded to `ndigits` when given)."""
    values = list(os.getloadavg())
    return values if ndigits is None else [round(x, ndigits) for x in values]


def load_average_text() -> list[str]:
    """The 1, 5 and 15 minute load averages as /proc/loadavg writes them."""
    with open("/proc/loadavg") as f:
        return f.read().split()[:3]


def mem_available_gib(ndigits: int | None = None) -> float:
    """MemAvailable of /proc/meminfo in GiB (rounded to `ndigits` when given); NaN when unreadable."""
    with contextlib.suppress(OSError, IndexError, ValueError):
        gib = int(Path("/proc/meminfo").read_text().split("MemAvailable:")[1].split()[0]) / 2**20
        return gib if ndigits is None else round(gib, ndigits)
    return float("nan")


def uptime() -> str:
    """`uptime`'s line (time up, users, load), or "" when it cannot run."""
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        return subprocess.run(["uptime"], check=True, capture_output=True, text=True).stdout.strip()
    return ""


def _gemm_rate(dtype: torch.dtype, reps: int = 5) -> float:
    """GFLOP/s of the fastest of `reps` n^3 GEMMs after one untimed (the machine's capability, not its busiest
    moment): n = 2048, or 512 where a 512^3 probe runs under 5 GFLOP/s (bfloat16 on an AVX2 host without BF16
    units: ~1.2 GFLOP/s at both sizes, and twelve 2048^3 GEMMs held a test for minutes; float32 there runs
    17-56 GFLOP/s at 512 with another process busy, emulated bfloat16 on AVX-512 hosts 51-64)."""
    import torch

    def best_of(n: int, calls: int) -> float:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        times = []
        for _ in range(calls):
            t = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t)
        return 2 * n**3 / min(times[1:]) / 1e9

    probe = best_of(512, 2)
    return probe if probe < 5 else best_of(2048, reps + 1)


def measure_machine(dtype: torch.dtype) -> dict[str, float]:
    """Read bandwidth (GB/s) from reducing a 1 GiB tensor; 2048^3 GEMM rates (GFLOP/s) in
    the compute dtype, in BF16 and in float32; ``bound_gemm_gflop_s`` is the best of the compute
    dtype's and float32's (bfloat16 weights run float32 GEMMs where that is faster,
    `backend/gemm_widen.py`), the rate the GEMM bound uses."""
    import torch

    big = torch.ones(2**28, dtype=torch.float32)  # 1 GiB
    big.sum()
    reps, t = 5, time.perf_counter()
    for _ in range(reps):
        big.sum()
    bandwidth = reps * big.numel() * 4 / (time.perf_counter() - t) / 1e9
    del big
    # a bfloat16 model's rate gets twice the repetitions (the noise of one 2048^3 timing is not the machine's:
    # seen 316 and 353 GFLOP/s in one run), measured once as both the compute dtype's and bfloat16's
    bf16 = _gemm_rate(torch.bfloat16, reps=10 if dtype == torch.bfloat16 else 5)
    rates = {"gemm_gflop_s": bf16 if dtype == torch.bfloat16 else _gemm_rate(dtype), "bf16_gemm_gflop_s": bf16,
             "float32_gemm_gflop_s": _gemm_rate(torch.float32)}
    return {"read_gb_s": bandwidth, **rates,
            "bound_gemm_gflop_s": max(rates["gemm_gflop_s"], rates["float32_gemm_gflop_s"])}
