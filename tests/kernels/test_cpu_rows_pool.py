"""The row-wise C kernels on the helper pool and on torch's OpenMP pool (`pool_rows`, kernels/cpu/pool.h): a
call large enough to be cut into chunks gives, bit for bit, what the same call gives on one thread, chunk edges
anywhere in the rows (row counts that do not divide evenly), and what torch's ops give. The sampler's row
kernels (argmax, the draws with top-k, top-p and masks) likewise, also with the threads handed over as a decode
step hands them. The paged attention's prompt tiles, shared out the same two ways, likewise."""

from __future__ import annotations

import pytest
import torch

import kernels.cpu_argmax as argmax_kernel
import kernels.cpu_rms_norm as norm_kernel
import kernels.cpu_sample as sample_kernel
import kernels.cpu_rope as rope_kernel
import kernels.cpu_silu_mul as silu_kernel
from kernels.cpu_paged_attention import paged_decode_attention_cpu
from kernels.cpu_threads import (RUN_OPENMP, RUN_POOL_SLEEP, run_mode, torch_runs_libgomp,
                                 torch_single_threaded)
from tests.kernels.test_cpu_argmax import _random_words
from tests.kernels.test_cpu_rope import _freqs, _torch
from tests.kernels.test_kv_store import seed  # noqa: F401  (fixture)

pytestmark = pytest.mark.skipif(not (silu_kernel.available() and norm_kernel.available() and rope_kernel.available()),
                                reason="CPU kernels not built")


@pytest.fixture(params=["openmp", "pool"])
def each_way(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Calls outside a handover shared out on torch's OpenMP pool (where torch runs libgomp) or on the helpers."""
    if request.param == "openmp" and not torch_runs_libgomp():
        pytest.skip("torch's OpenMP runtime here is not libgomp: calls run on the helper pool")
    monkeypatch.setenv("EDGESERVE_KERNEL_OPENMP", "1" if request.param == "openmp" else "0")
    assert run_mode() == (RUN_OPENMP if request.param == "openmp" else RUN_POOL_SLEEP)
    return request.param


def _both(fn, *args):
    """fn(*args) with torch (so the kernels) at 2 threads, then at 1, each on fresh copies of the inputs."""
    threads = torch.get_num_threads()
    out = []
    try:
        for n in (2, 1):
            torch.set_num_threads(n)
            copies = [a.clone() for a in args]
            out.append((fn(*copies), copies))
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.mark.parametrize("rows", [97, 301])
def test_chunked_calls_equal_one_thread(rows: int, seed: int, each_way: str) -> None:
    gate_up = torch.randn(rows, 2 * 1536).bfloat16()
    (two, _), (one, _) = _both(silu_kernel.silu_mul_bf16, gate_up)
    assert rows * 1536 >= 4 * 16384  # cut into chunks at 2 threads (pool.h's POOL_ROWS_MIN_VALUES)
    gate, up = gate_up.float().chunk(2, dim=-1)
    assert torch.equal(two.view(torch.int16), one.view(torch.int16))
    torch.testing.assert_close(two.float(), (torch.nn.functional.silu(gate).bfloat16().float() * up), rtol=2 ** -7,
                               atol=1e-30)

    h, branch, w = torch.randn(rows, 576).bfloat16(), torch.randn(rows, 576).bfloat16(), torch.randn(576).bfloat16()
    (two, (h2, _, _)), (one, (h1, _, _)) = _both(lambda x, b, ww: norm_kernel.add_rms_norm_bf16(x, b, ww, 1e-5), h,
                                                 branch, w)
    assert torch.equal(h2.view(torch.int16), h1.view(torch.int16))
    assert torch.equal(h2.view(torch.int16), (h + branch).view(torch.int16))
    assert torch.equal(two.view(torch.int16), one.view(torch.int16))
    (plain, _), _ = _both(lambda x, ww: norm_kernel.rms_norm_bf16(x, ww, 1e-5), h + branch, w)
    assert torch.equal(plain.view(torch.int16), two.view(torch.int16))
    ref = (w.float() * torch.nn.functional.rms_norm((h + branch).float(), (576,), eps=1e-5).bfloat16().float())
    torch.testing.assert_close(two.float(), ref, rtol=2 ** -6, atol=1e-30)

    x, freqs = torch.randn(rows, 12 * 64).bfloat16().view(rows, 12, 64), _freqs(rows, 32)
    (two, _), (one, _) = _both(rope_kernel.rope_bf16, x, freqs)
    assert torch.equal(two.view(torch.int16), one.view(torch.int16))
    # against torch within an ulp, plus float32's rounding of the two products where they cancel (as
    # test_cpu_rope; seen: 2.98e-8 off on a result of 4.8e-7, relative 0.06)
    ref, pair = _torch(x, freqs).float(), x.float().view(rows, 12, 32, 2).abs().sum(-1, keepdim=True)
    size = 1.1 * pair.expand(-1, -1, -1, 2).reshape(rows, 12, 64)  # |a c| + |b d| at most, |c|, |d| <= 1.1
    assert bool(((two.float() - ref).abs() <= ref.abs() * 2.0 ** -7 + size * 2.0 ** -21).all()), f"seed {seed}"


@pytest.mark.skipif(not (argmax_kernel.available() and sample_kernel.available()), reason="sampler kernels not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sampler_rows_are_drawn_alike_on_one_thread_and_on_the_pool(dtype: torch.dtype, seed: int,
                                                                      each_way: str) -> None:
    rows, vocab = 13, 20011  # a row alone is large enough for a chunk of its own (3 x 20,011 values weighed)
    x = (torch.randn(rows, vocab) * 3).to(dtype)
    x[3, 17] = float("nan")
    words = _random_words(rows, vocab, 0.4)
    words[:, 0] |= 1
    inv_t, u = (1 / (torch.rand(rows) + 0.3)).float(), torch.rand(rows, dtype=torch.float64)
    top_k = torch.randint(0, 300, (rows,), dtype=torch.int32)
    top_p = torch.where(torch.rand(rows) < 0.7, torch.rand(rows) * 0.9 + 0.05, torch.ones(rows))
    calls = {"argmax": lambda: argmax_kernel.argmax_rows(x),
             "argmax masked": lambda: argmax_kernel.argmax_rows(x, words),
             "draws": lambda: sample_kernel.sample_rows(x, inv_t, u, words, top_k, top_p)}
    for name, call in calls.items():
        (two, _), (one, _) = _both(call)
        with torch_single_threaded():  # the kernels own both cores, their helpers linger between calls
            handed = call()
        assert torch.equal(two, one) and torch.equal(handed, one), name
    assert int(calls["argmax"]()[3]) == 17  # the NaN, as torch.argmax answers
    assert torch.equal(calls["argmax"](), x.float().argmax(dim=-1))


def test_prompt_tiles_are_attended_alike_on_one_thread_and_shared_out(seed: int, each_way: str) -> None:
    """A prompt chunk's tiles (work items claimed as threads come free) give the one-thread call's bits."""
    from tests.kernels.test_cpu_paged_attention import _prompt_rows
    from tests.kernels.test_paged_attention import FORMATS, build_paged, random_layout, random_sequences

    lens = [300, 3]
    num_pages, page_table = random_layout(lens)
    paged = build_paged(random_sequences(lens, 2, 64), 2, 64, FORMATS["bf16"], num_pages, page_table, "cpu")
    table, keys = _prompt_rows(paged, lens, (200, 300))
    rows = paged._replace(page_table=table, context_lens=keys)
    q = torch.randn(len(keys), 6, 64).bfloat16()
    tiles = torch.tensor([0, *range(1, len(keys), 10), len(keys)], dtype=torch.int32)
    one = paged_decode_attention_cpu(q, *rows, 0.125, threads=1, tiles=tiles)
    two = paged_decode_attention_cpu(q, *rows, 0.125, threads=2, tiles=tiles)
    assert one is not None and two is not None
    assert torch.equal(two.view(torch.int16), one.view(torch.int16))
