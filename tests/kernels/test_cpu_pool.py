"""The helper pool the CPU kernels share (kernels/cpu/pool.c): the bf16 GEMV and the paged decode attention
called at once from two Python threads, helpers spinning after a call (linger) or asleep (no linger),
right on fresh random inputs every time; and each kernel still right on its caller's thread alone when it
was handed no pool."""

from __future__ import annotations

import contextlib
import ctypes
import threading
import time

import pytest
import torch

from kernels import cpu_build, cpu_gemv, cpu_paged_attention
from kernels.cpu_paged_attention import paged_decode_attention_cpu
from kernels.cpu_threads import torch_single_threaded
from kernels.paged_attention import paged_decode_attention_ref
from tests.kernels.test_cpu_gemv import _check
from tests.kernels.test_kv_store import seed  # noqa: F401  (fixture)
from tests.kernels.test_paged_attention import (LENS, assert_close_in_mag, build_paged, random_layout,
                                                random_sequences)

pytestmark = pytest.mark.skipif(
    not (cpu_paged_attention.available() and cpu_build.POOL.load() is not None),
    reason=f"CPU kernels or their pool not built: {cpu_paged_attention.build_error() or cpu_build.POOL.error}")


def _attention_case() -> tuple:
    num_pages, page_table = random_layout(LENS)
    paged = build_paged(random_sequences(LENS, 2, 64), 2, 64, torch.bfloat16, num_pages, page_table, "cpu")
    q = torch.randn(len(LENS), 6, 64)
    return q, paged, paged_decode_attention_ref(q, *paged, 0.125), paged_decode_attention_ref(q, *paged.with_abs_v(),
                                                                                              0.125)


@pytest.mark.parametrize("linger", [True, False])
def test_two_kernels_from_two_threads_share_the_pool(linger: bool, seed: int) -> None:
    """One thread calls the attention, the other the GEMV (when this CPU has it), 60 times each, pausing now
    and then past the helpers' spin; a call that finds the pool busy runs alone. Every result is right."""
    q, paged, ref, mag = _attention_case()
    gemv = cpu_gemv.available()
    x, w = torch.randn(3, 576).bfloat16(), (torch.randn(1536, 576) * 0.05).bfloat16()
    errors: list[str] = []

    def attention() -> None:
        with torch_single_threaded() if linger else contextlib.nullcontext():
            for r in range(60):
                try:
                    assert_close_in_mag(paged_decode_attention_cpu(q, *paged, 0.125, threads=2), ref, mag, 1e-5,
                                        seed)
                except AssertionError as exc:
                    errors.append(f"attention: {exc}")
                if r % 20 == 19:
                    time.sleep(0.002)

    def linear() -> None:
        for _ in range(60):
            try:
                _check(cpu_gemv.gemv_bf16(x, w, 2), x, w, seed)
            except AssertionError as exc:
                errors.append(f"gemv: {exc}")

    threads = [threading.Thread(target=attention)] + ([threading.Thread(target=linear)] if gemv else [])
    for t in threads:
        t.start()
    attention()  # and this thread too: three callers, one pool
    for t in threads:
        t.join()
    assert not errors, errors[:3]


def test_a_kernel_handed_no_pool_runs_every_chunk_itself(seed: int) -> None:
    lib = cpu_paged_attention.KERNEL.load()
    q, paged, ref, mag = _attention_case()
    lib.set_pool(None)
    try:
        assert_close_in_mag(paged_decode_attention_cpu(q, *paged, 0.125, threads=2), ref, mag, 1e-5, seed)
    finally:
        lib.set_pool(ctypes.cast(cpu_build.POOL.load().pool_run, ctypes.c_void_p))
    assert_close_in_mag(paged_decode_attention_cpu(q, *paged, 0.125, threads=2), ref, mag, 1e-5, seed)

