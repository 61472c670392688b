"""`bench weights`' quality measure (ops/bench/weights/measures.py `quality`): perplexity, top-1 and the KL to a
reference format are those of the engines' own next-token distributions, over the windows they say."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ops.bench.weights.measures import Quality, paired_quality, quality
from tests.backend.test_weight_formats import _engine, _prefill_logits
from tests.backend.tiny_models import write_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("bw") / "m", "llama", seed=3, initializer_range=0.1)


def _windows(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 320, (n,), generator=g).tolist() for n in (40, 33, 57)]


def test_quality_kl_is_the_engines_distributions(tiny: Path) -> None:
    """The KL from the reference's kept windows is the mean over those windows of KL(dense || int4) computed
    from the two engines' logits; a format against itself scores 0; windows past the reference's count
    only in perplexity and top-1, which are the mean log-probability and argmax hits of every window."""
    windows = _windows(1)
    dense, int4 = _engine(tiny), _engine(tiny, prefill_weights="int4", decode_weights="int4", int4_group_size=32)
    ref = quality(dense, windows, keep=2)
    assert ref.kl is None and len(ref.dists) == 2 and ref.dists[0].dtype == torch.float16
    assert ref.dists[1].shape == (len(windows[1]) - 1, dense.model.cfg.vocab_size)

    nll, hits, n = 0.0, 0, 0
    want_kl = []
    for j, w in enumerate(windows):
        q = F.log_softmax(_prefill_logits(int4, w)[:-1].float(), dim=-1)
        target = torch.tensor(w[1:])
        nll -= float(q.gather(1, target[:, None]).sum())
        hits += int((q.argmax(-1) == target).sum())
        n += len(w) - 1
        if j < 2:
            p = ref.dists[j].float()  # the reference as kept (float16)
            want_kl.append(float((p.exp() * (p - q)).sum(-1).mean()))

    got = quality(int4, windows, ref.dists)
    assert got.tokens == n and got.dists == []
    assert [len(x) for x in got.nll] == [len(w) - 1 for w in windows] == [len(h) for h in got.hits]
    assert sum(float(x.sum()) for x in got.nll) == pytest.approx(nll, rel=1e-6)
    assert sum(int(h.sum()) for h in got.hits) == hits
    assert got.ppl == pytest.approx(math.exp(nll / n), rel=1e-4)
    assert got.top1 == pytest.approx(hits / n)
    assert got.kl > 1e-4  # INT4 g32 of random weights moves the model
    assert got.kl == pytest.approx(sum(want_kl) / 2, rel=1e-3)
    assert quality(dense, windows, ref.dists).kl == pytest.approx(0.0, abs=5e-5)  # float16-rounded reference


def _scored(nll: list[np.ndarray], hits: list[np.ndarray]) -> Quality:
    n = sum(len(x) for x in nll)
    return Quality(math.exp(sum(float(x.sum()) for x in nll) / n), sum(int(h.sum()) for h in hits) / n, n, None,
                   [], nll, hits)


def test_paired_quality_keeps_each_tokens_losses_together() -> None:
    """Two formats whose losses differ by the same small amount on every token, over text whose losses vary a
    lot: the paired interval is exact (every resample sees the same difference), where resampling the two
    formats' tokens apart would straddle the difference by far."""
    rng = np.random.default_rng(0)
    base = [rng.exponential(3.0, size=n) for n in (511, 300)]
    hits_b = [rng.random(len(x)) < 0.35 for x in base]
    hits_a = [h.copy() for h in hits_b]
    hits_a[0][:40] = ~hits_a[0][:40]  # 40 of 811 tokens flip: the difference is what those flips add up to
    a, b = _scored([x + 0.02 for x in base], hits_a), _scored(base, hits_b)
    got = paired_quality(a, b)
    assert got["ppl_ratio"] == pytest.approx(a.ppl / b.ppl) == pytest.approx(math.exp(0.02))
    assert got["ppl_ratio_ci95"] == pytest.approx([math.exp(0.02)] * 2)
    flipped = int(hits_a[0].sum()) - int(hits_b[0].sum())
    assert got["top1_pp"] == pytest.approx(100 * flipped / 811) == pytest.approx(100 * (a.top1 - b.top1))
    lo, hi = got["top1_pp_ci95"]
    assert lo <= got["top1_pp"] <= hi and hi - lo > 0.1  # the flips fall in some resamples' blocks, not others

    # unrelated losses (no pairing to lean on): the interval is wide and holds the point figure
    other = _scored([rng.exponential(3.0, size=len(x)) for x in base], hits_b)
    wide = paired_quality(other, b)
    assert wide["ppl_ratio_ci95"][0] < wide["ppl_ratio"] < wide["ppl_ratio_ci95"][1]
    assert wide["ppl_ratio_ci95"][1] / wide["ppl_ratio_ci95"][0] > 1.1
