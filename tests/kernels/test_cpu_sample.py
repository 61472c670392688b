"""The sampling kernel (kernels/cpu/sample.c) against the softmax's CDF computed in float64 on fresh random
logits: float32 and bfloat16 rows, temperatures, grammar mask words, -inf (cut) tokens, vocabularies that are
not multiples of 32; the special rows (NaN, +inf, nothing allowed); the drawn frequencies; what it declines;
and the sampler's per-row routing (a seeded row's token whatever shares its batch)."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu_sample import available, build_error, sample_rows
from tests.kernels.test_cpu_argmax import _random_words, _torch_masked
from tests.kernels.test_kv_store import seed  # noqa: F401  (fixture)

pytestmark = pytest.mark.skipif(not available(), reason=f"sampling kernel not built: {build_error()}")


def _cdf(x: torch.Tensor, temperature: torch.Tensor, words: torch.Tensor | None) -> torch.Tensor:
    """The reference: each row's running sum of softmax(x / T) in float64, forbidden tokens at 0."""
    xf = x.float() if words is None else _torch_masked(x, words)
    return (xf.double() / temperature.double().unsqueeze(1)).softmax(dim=-1).cumsum(dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 31, 32, 1000, 49152, 49157])
@pytest.mark.parametrize("masked", [False, True])
def test_draws_the_token_whose_cdf_interval_holds_u(vocab: int, masked: bool, dtype: torch.dtype, seed: int) -> None:
    rows = 16
    x = (torch.randn(rows, vocab) * 4).to(dtype)
    if vocab > 1:
        x[0, vocab // 3 + 1] = float("-inf")  # a cut token
    temperature = torch.rand(rows) * 2 + 0.05
    words = _random_words(rows, vocab, 0.3) if masked else None
    if masked:
        words[:, 0] |= 1  # every row allows at least token 0
    u = torch.rand(rows, dtype=torch.float64)
    got = sample_rows(x, (1 / temperature).float(), u, words)
    cdf = _cdf(x, temperature, words)
    for r in range(rows):
        k, target = int(got[r]), float(u[r])
        below = float(cdf[r, k - 1]) if k else 0.0
        assert below - 1e-5 <= target <= float(cdf[r, k]) + 1e-5  # the interval of token k holds u (to rounding)
        assert float(cdf[r, k]) > below  # a token of probability 0 is never drawn
        if masked:
            assert (int(words[r, k // 32]) >> (k % 32)) & 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [7, 1000, 49157])
def test_top_k_and_top_p_cut_as_the_torch_path(vocab: int, dtype: torch.dtype, seed: int) -> None:
    from backend.sampler import _apply_top_k, _apply_top_p

    rows = 24
    x = (torch.randn(rows, vocab) * torch.rand(rows, 1) * 8).to(dtype)  # flat to peaked rows
    x[:, 3] = x[:, 2]  # a tie (a cut can fall on it)
    temperature = torch.rand(rows) + 0.3
    ks = [[0, 1, 2, 5, 40, vocab, vocab + 3][r % 7] for r in range(rows)]
    ps = [[1.0, 0.5, 0.9, 0.95, 0.1, 0.999][r % 6] for r in range(rows)]
    words = _random_words(rows, vocab, 0.7)
    words[:, 0] |= 1
    u = torch.rand(rows, dtype=torch.float64)
    got = sample_rows(x, (1 / temperature).float(), u, words, torch.tensor(ks, dtype=torch.int32),
                      torch.tensor(ps, dtype=torch.float32))
    masked = _torch_masked(x, words)
    # The torch path's cut (float32) and the same cut computed in float64. They can differ by a group of tied
    # tokens at the top-p boundary: bfloat16 logits tie often, and ~16k float32 sums put the mass before a tie
    # group on either side of p. A kernel that keeps either set draws correctly; any other set fails both.
    refs = [_apply_top_p(_apply_top_k(m / t.unsqueeze(1), ks), ps)
            for m, t in ((masked, temperature), (masked.double(), temperature.double()))]
    cdfs = [ref.double().softmax(dim=-1).cumsum(dim=-1) for ref in refs]

    def holds(r: int, k: int, target: float, ref: torch.Tensor, cdf: torch.Tensor) -> bool:
        below = float(cdf[r, k - 1]) if k else 0.0
        return bool(torch.isfinite(ref[r, k])) and below - 1e-5 <= target <= float(cdf[r, k]) + 1e-5

    for r in range(rows):
        k, target = int(got[r]), float(u[r])
        assert any(holds(r, k, target, ref, cdf) for ref, cdf in zip(refs, cdfs)), (r, k, ks[r], ps[r], target)


def test_frequencies_follow_the_softmax(seed: int) -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, float("-inf"), 0.5, -30.0, 3.0]).repeat(40000, 1)
    temperature = 1.3
    out = sample_rows(logits, torch.full((40000,), 1 / temperature), torch.rand(40000, dtype=torch.float64))
    freq = torch.bincount(out, minlength=8).double() / 40000
    want = (logits[0].double() / temperature).softmax(-1)
    assert (freq - want).abs().max().item() < 0.01 and freq[4] == 0


def test_special_rows() -> None:
    x = torch.randn(4, 100)
    x[0, 70], x[0, 90] = float("nan"), float("nan")  # the first NaN, as the argmax
    x[1, 40], x[1, 60] = float("inf"), float("inf")  # the first +inf holds all the mass
    words = torch.full((4, 4), -1, dtype=torch.int32)
    words[2] = 0  # nothing allowed: 0
    words[3, 1] = 0  # tokens 32..63 forbidden, among them a NaN and a +inf that must not count
    x[3, 33], x[3, 50] = float("nan"), float("inf")
    got = sample_rows(x, torch.ones(4), torch.full((4,), 0.5, dtype=torch.float64), words).tolist()
    assert got[:3] == [70, 40, 0] and not 32 <= got[3] < 64


def test_declines_what_it_does_not_handle() -> None:
    x, t, u = torch.randn(4, 64), torch.ones(4), torch.rand(4, dtype=torch.float64)
    assert sample_rows(x.half(), t, u) is None
    assert sample_rows(x.t(), t, u) is None  # strided
    assert sample_rows(x, t.double(), u) is None and sample_rows(x, t, u.float()) is None
    assert sample_rows(x, t[:3], u) is None
    assert sample_rows(x, t, u, torch.zeros(4, 1, dtype=torch.int32)) is None  # too few words
    assert sample_rows(torch.empty(0, 64), torch.ones(0), torch.rand(0, dtype=torch.float64)).shape == (0,)


def test_the_sampler_draws_plain_rows_with_it_and_a_seeded_row_is_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    import backend.sampler as sampler
    from backend.sampling_params import SamplingParams
    from kernels import cpu_sample

    calls = []
    real = cpu_sample.sample_rows
    monkeypatch.setattr(cpu_sample, "sample_rows", lambda x, *a: calls.append((x.dtype, x.shape)) or real(x, *a))
    logits = (torch.randn(3, 300) * 3).to(torch.bfloat16)
    seeded = SamplingParams(temperature=0.9, seed=7)

    def draw(params: list[SamplingParams]) -> int:
        gens = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]
        n = len(params)
        return sampler.sample(logits[:n], params, gens, [[]] * n, [[1, 2]] * n)[0]

    alone = [draw([seeded]) for _ in range(3)]
    assert calls == [(torch.bfloat16, (1, 300))] * 3  # the logits as the LM head left them, no float32 copy
    calls.clear()
    mixed = draw([seeded, SamplingParams(temperature=1.0, frequency_penalty=0.5), SamplingParams(temperature=0.0)])
    assert calls == [(torch.bfloat16, (1, 300)), (torch.float32, (2, 300))]  # plain row; torch-prepared rows
    assert mixed == alone[0]
    several = {draw([SamplingParams(temperature=0.9, seed=s)]) for s in range(40)}
    assert len(several) > 3  # it samples: different seeds, different tokens
