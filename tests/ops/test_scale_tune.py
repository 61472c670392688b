"""End-to-end INT4 scale tuning after GPTQ (ops/scale_tune.py): its forward is the runtime's, tuning brings the
quantised model's next-token distribution closer to the dense model's without changing a code, on every INT4 grid
`edgeserve quantize` writes, and it refuses what it does not cover."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from backend.compressed_tensors_write import PackQuantizedWriter
from backend.config import load_config
from backend.errors import WeightsError
from backend.weight_formats import StoredWeight, weight_format
from backend.weights import CheckpointReader
from ops import quantize
from ops.scale_tune import tune_scales
from tests.backend.test_weight_formats import _engine, _prefill_logits
from tests.backend.tiny_models import write_tiny_glm4_moe, write_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2 (q/k/v biases) with an untied LM head, its weights wide enough (std 0.1, not
    0.02) that its next-token distributions are far from uniform."""
    return write_tiny_model(tmp_path_factory.mktemp("tune") / "m", "qwen2", seed=7, initializer_range=0.1)


def _ids(seed: int, n: int = 4, length: int = 64) -> torch.Tensor:
    return torch.randint(3, 320, (n, length), generator=torch.Generator().manual_seed(seed))


def _runtime_kl(dense: Path, quantised: Path, ids: torch.Tensor) -> float:
    """Mean KL(dense || quantised) of the engines' next-token distributions over every position of ids."""
    a, b = _engine(dense), _engine(quantised)
    kls = []
    for row in ids.tolist():
        p, q = (F.log_softmax(_prefill_logits(e, row).float(), dim=-1) for e in (a, b))
        kls.append((p.exp() * (p - q)).sum(-1).mean())
    return float(torch.stack(kls).mean())


def _layers(path: Path, n_layers: int) -> list[dict[str, StoredWeight]]:
    """The INT4 linears of a written edgeserve-layout checkpoint, per layer."""
    r = CheckpointReader(path)
    out: list[dict[str, StoredWeight]] = [{} for _ in range(n_layers)]
    for name in r.names():
        if name.endswith(".qweight"):
            m = name.rsplit(".", 1)[0]
            q = r.get(name)
            out[int(m.split(".")[2])][m] = StoredWeight({"qweight": q, "scales": r.get(f"{m}.scales"),
                                                         "zeros": r.get(f"{m}.zeros")}, (q.shape[0], 2 * q.shape[1]))
    return out


def test_the_tuners_kl_is_the_runtimes(tiny: Path, tmp_path: Path) -> None:
    """Before any step, the KL the tuner computes (its dense teacher against its quantised forward) is the
    one between our engine's dense and INT4 models on the same tokens: both forwards are the runtime's."""
    ids = _ids(1, 2, 48)
    fmt = weight_format("int4", 32)
    quantize.quantize_checkpoint(tiny, tmp_path / "q", fmt, method="gptq", calib_ids=_ids(0), tune_epochs=0,
                                 progress=False)
    cfg = load_config(tiny)
    reader = CheckpointReader(tiny)
    layers = _layers(tmp_path / "q", cfg.num_layers)
    stats = tune_scales(cfg, ids, reader.get, reader.__contains__, lambda m: reader.get(f"{m}.weight").float(),
                        layers, 32, False, lambda m: pytest.fail(f"{m} is not kept"), epochs=0)
    assert stats.steps == 0 and stats.sequences == 2 and stats.seq_len == 48
    runtime = _runtime_kl(tiny, tmp_path / "q", ids)
    assert stats.kl_start > 1e-4  # INT4 g32 of random weights is far from exact
    # the tuner holds its teacher's log-probs in bfloat16 (8 significant bits: 0.0625 apart at -10); rounding
    # the engine's dense log-probs to bfloat16 moves this KL by 2e-4 (0.02664 -> 0.02684): they agree to that
    assert stats.kl_start == pytest.approx(runtime, abs=3e-4)
    assert stats.kl_end == pytest.approx(stats.kl_start, rel=1e-6)  # no step: the stored values are GPTQ's


@pytest.mark.parametrize("grid", ["edgeserve", "symmetric", "integer-zero"])
def test_tuning_lowers_the_kl_and_changes_only_scales(tiny: Path, tmp_path: Path, grid: str) -> None:
    """The tuned checkpoint has GPTQ's codes (and zero points) and other scales, and our engine's KL to the
    dense model on the calibration tokens falls, as the tuner's own report says."""
    fmt = {"edgeserve": weight_format("int4", 32), "symmetric": PackQuantizedWriter(32),
           "integer-zero": PackQuantizedWriter(32, symmetric=False)}[grid]
    calib = _ids(0)
    plain = quantize.quantize_checkpoint(tiny, tmp_path / "gptq", fmt, method="gptq", calib_ids=calib,
                                         tune_epochs=0, progress=False)
    tuned = quantize.quantize_checkpoint(tiny, tmp_path / "tuned", fmt, method="gptq", calib_ids=calib,
                                         tune_epochs=4, tune_lr=4e-3, progress=False)
    assert plain.calibration.tune is None
    stats = tuned.calibration.tune
    assert stats.steps == 4 * calib.shape[0] and stats.kl_end < 0.8 * stats.kl_start, stats
    a, b = CheckpointReader(tmp_path / "gptq"), CheckpointReader(tmp_path / "tuned")
    assert list(a.names()) == list(b.names()) and all(a.spec(n) == b.spec(n) for n in a.names())
    differ = {n for n in a.names() if not torch.equal(a.get(n), b.get(n))}
    scale = ".scales" if grid == "edgeserve" else ".weight_scale"
    assert differ and all(n.endswith(scale) or (grid == "edgeserve" and n.endswith(".zeros")) for n in differ)
    assert len([n for n in differ if n.endswith(scale)]) == 7 * load_config(tiny).num_layers  # every linear
    before, after = _runtime_kl(tiny, tmp_path / "gptq", calib), _runtime_kl(tiny, tmp_path / "tuned", calib)
    assert after < 0.8 * before, (before, after)
    assert after == pytest.approx(stats.kl_end, rel=0.05)


def test_what_tuning_does_not_cover(tmp_path: Path) -> None:
    """An MoE decoder: asked for, a typed error before anything is written; by default, not tuned."""
    moe = write_tiny_glm4_moe(tmp_path / "moe", seed=2)
    fmt = weight_format("int4", 32)
    with pytest.raises(WeightsError, match="mixture-of-experts"):
        quantize.quantize_checkpoint(moe, tmp_path / "a", fmt, method="gptq", calib_ids=_ids(0, 2, 32),
                                     tune_epochs=2, progress=False)
    assert not (tmp_path / "a").exists()
    report = quantize.quantize_checkpoint(moe, tmp_path / "b", fmt, method="gptq", calib_ids=_ids(0, 2, 32),
                                          progress=False)
    assert report.calibration.tune is None and report.calibration.gptq_linears > 0
    with pytest.raises(WeightsError, match="0 or more"):
        quantize.quantize_checkpoint(moe, tmp_path / "c", fmt, method="gptq", calib_ids=_ids(0, 2, 32),
                                     tune_epochs=-1, progress=False)


def test_a_linear_kept_dense_stays_dense_through_tuning(tiny: Path, tmp_path: Path) -> None:
    """An ignored linear is written dense and the tuned model runs it dense: the tuner's final KL is the
    runtime's KL of the written checkpoint."""
    calib = _ids(0)
    kept = "model.layers.1.mlp.down_proj"
    report = quantize.quantize_checkpoint(tiny, tmp_path / "q", weight_format("int4", 32), method="gptq",
                                          calib_ids=calib, ignore=[kept], tune_epochs=2, tune_lr=4e-3, progress=False)
    written = CheckpointReader(tmp_path / "q")
    assert f"{kept}.weight" in written and f"{kept}.qweight" not in written
    torch.testing.assert_close(written.get(f"{kept}.weight"), CheckpointReader(tiny).get(f"{kept}.weight"))
    stats = report.calibration.tune
    assert stats.kl_end < stats.kl_start
    assert _runtime_kl(tiny, tmp_path / "q", calib) == pytest.approx(stats.kl_end, rel=0.05)


def test_tuning_that_does_not_help_keeps_gptqs_scales(tiny: Path, tmp_path: Path) -> None:
    """Steps far too large (the learning rate 1, in units of a group's scale) leave the model further from
    the dense one on the calibration tokens: the written checkpoint is GPTQ's, bit for bit, and says so."""
    fmt, calib = weight_format("int4", 32), _ids(0)
    quantize.quantize_checkpoint(tiny, tmp_path / "gptq", fmt, method="gptq", calib_ids=calib, tune_epochs=0,
                                 progress=False)
    report = quantize.quantize_checkpoint(tiny, tmp_path / "wild", fmt, method="gptq", calib_ids=calib,
                                          tune_epochs=1, tune_lr=1.0, progress=False)
    stats = report.calibration.tune
    assert stats.kept_gptq and stats.kl_end > stats.kl_start
    a, b = CheckpointReader(tmp_path / "gptq"), CheckpointReader(tmp_path / "wild")
    assert all(torch.equal(a.get(n), b.get(n)) for n in a.names())
