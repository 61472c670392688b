"""End-to-end tuning of INT4 group scales and zeros against the dense model, GPTQ's codes kept.

GPTQ (`ops/gptq.py`) chooses each linear's codes against that linear's own output error, one layer
at a time (`ops/calibration.py`); nothing in it sees how the errors of every linear add up at the
logits. With the codes fixed, this stage tunes each (row, group)'s scale and zero by gradient
descent on the whole quantised model's next-token distribution, distilled from the dense model's
on the calibration tokens (the step-size-only end-to-end stage of EfficientQAT, with a KL loss):

    loss = mean over tokens of KL(p_dense || p_quant)          # p: the next-token distribution
    s = s0 * exp(a),  z = z0 + b * s0                          # a, b [N, G] from 0: GPTQ's result
    fixed-zero grids (compressed-tensors' symmetric and integer-zero ones): z = -zp * s, zp fixed

so a step moves every group in units of its own scale. Adam, the learning rate decayed to 0 by a
cosine over all steps, one calibration sequence a step, the sequences shuffled each epoch (seeded),
calibration sequences cut into `seq_len`-token pieces (more, shorter steps; each piece attends from
its own first token, teacher and student alike). Only scales and zeros move, about 2 numbers per
`group_size` weights, and still they fit the calibration text: on SmolLM2 g128 after 4 epochs over 8,192 tokens
the calibration KL was 0.035 and the held-out one 0.083; 2 epochs over 16,384 tokens (the same steps) held out
0.069, and 1 over 32,768 the same (BENCHMARKS.md). Hence 2 epochs over `quantize`'s 16,384 tokens.

Numerics: float32 forward and backward. The dense log-probabilities are computed once, one layer's
dense weights at a time over every sequence, and kept in bfloat16 ([tokens, vocab]: 1.6 GB for
16,384 tokens of a 49,152-token vocabulary). The quantised forward holds every linear's codes (int8)
and float32 scales and zeros and dequantises each weight as a step reaches it, so autograd keeps one
float32 copy of every linear besides one sequence's activations (`tune_bytes`). The tuned scales
and zeros are rounded to bfloat16 as stored (on an integer-zero grid z = bfloat16(-zp s)); a group
whose tuned scale is not positive and finite keeps GPTQ's, and when the tuned model's KL on the
calibration tokens is not below GPTQ's, every layer keeps GPTQ's scales (a model GPTQ already
matches, SmolLM2 at g32 with KL 0.0006, is only moved away by Adam's unit-size steps).

Architectures: decoders of GQA attention and dense SwiGLU MLPs (Llama, Qwen2/3, SmolLM2), the
layer forward of `ops/calibration.py` (`gqa_attention`). MoE and MLA decoders are not tuned
(`untunable` says why).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

from backend.config import ModelConfig
from backend.errors import WeightsError
from backend.layers.norm import rms_norm
from backend.rope import rope_inv_freq
from backend.weight_formats import StoredWeight
from ops.calibration import LayerCalibrator, gqa_attention

__all__ = ["TuneStats", "TunedLayers", "tune_scales", "untunable", "tune_bytes", "kl_divergence",
           "DEFAULT_TUNE_EPOCHS", "DEFAULT_TUNE_LR", "DEFAULT_TUNE_SEQ_LEN"]

DEFAULT_TUNE_EPOCHS = 2  # over 16,384 tokens: as close to the dense model held out as 1 over 32,768, cheaper
# Adam's step in units of a group's scale (a: log scale, b: zero in steps). Of 1e-3, 3e-3 and 6e-3 on SmolLM2 g128,
# 1e-3 came closest to the dense model on held-out text (KL -11% against GPTQ's; 3e-3 -2.5% for a lower perplexity
# that was fit to the calibration corpus, not to the dense model: BENCHMARKS.md).
DEFAULT_TUNE_LR = 1e-3
DEFAULT_TUNE_SEQ_LEN = 512

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def untunable(cfg: ModelConfig) -> str | None:
    """Why `cfg`'s decoder cannot be tuned here, or None when it can."""
    if cfg.is_mla:
        return f"{cfg.architecture} uses multi-head latent attention"
    if any(cfg.is_moe_layer(i) for i in range(cfg.num_layers)):
        return f"{cfg.architecture} has mixture-of-experts layers"
    return None


def tune_bytes(cfg: ModelConfig, tokens: int, linear_params: int, seq_len: int = DEFAULT_TUNE_SEQ_LEN) -> int:
    """Rough peak bytes of `tune_scales`: the dense log-probs (bfloat16), every linear's codes (int8) and
    dequantised float32 weight with what autograd keeps of it and what the allocator holds between steps
    (24 bytes a weight), one sequence's activations, and its logits with the KL's float32 copies of them.
    Calibrated on SmolLM2 (106 M linear weights, 16,384 tokens): 5.4 GB peak RSS measured in process, against
    1.2 GB for GPTQ alone; this says 5.4 GB."""
    acts = seq_len * cfg.num_layers * (8 * cfg.hidden_size + 4 * cfg.intermediate_size) * 4
    return 2 * tokens * cfg.vocab_size + 24 * linear_params + acts + 6 * 4 * seq_len * cfg.vocab_size


@dataclass
class TuneStats:
    """What tuning did, for the size report."""

    epochs: int = 0
    steps: int = 0
    sequences: int = 0
    seq_len: int = 0
    kl_start: float = math.nan  # mean KL to the dense model over the calibration tokens, GPTQ's scales
    kl_end: float = math.nan  # the same with the tuned scales (bfloat16-rounded)
    kept_gptq: bool = False  # tuning did not lower the KL, so GPTQ's scales were kept
    seconds: float = 0.0


class _Groups:
    """One linear's fixed codes and tunable group scales and zeros (see the module docstring)."""

    def __init__(self, sw: StoredWeight, group_size: int, fixed_zero: bool) -> None:
        q, s0, z0 = sw.tensors["qweight"], sw.tensors["scales"].float(), sw.tensors["zeros"].float()
        n, k = sw.shape
        self.shape, self.fixed_zero = (n, k), fixed_zero
        codes = torch.stack([q & 15, q >> 4], dim=-1).reshape(n, -1)[:, :k].to(torch.int8) - 8  # [N, K]
        self.codes = F.pad(codes, (0, s0.shape[1] * group_size - k)).view(n, s0.shape[1], group_size)  # [N, G, g]
        self.s0, self.z0 = s0, z0
        self.zp = torch.round(-z0 / s0) if fixed_zero else None  # each group's zero point, in steps
        self.a = torch.zeros_like(s0, requires_grad=True)
        self.b = torch.zeros_like(s0, requires_grad=not fixed_zero)

    def params(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(s, z) [N, G] float32 as the autograd graph sees them."""
        s = self.s0 * torch.exp(self.a)
        return s, (-self.zp * s if self.fixed_zero else self.z0 + self.b * self.s0)

    def weight(self) -> torch.Tensor:
        """The dequantised weight [N, K] float32, broadcast over each group (autograd keeps the int8 codes
        and this one float32 weight, not expanded copies of the scales)."""
        s, z = self.params()
        n, k = self.shape
        return (self.codes * s[:, :, None] + z[:, :, None]).view(n, -1)[:, :k]

    @torch.no_grad()
    def stored(self, sw: StoredWeight) -> StoredWeight:
        """`sw` with the tuned scales and zeros, bfloat16-rounded (GPTQ's where the scale went bad)."""
        s, z = self.params()
        bad = ~(torch.isfinite(s) & (s > 0) & torch.isfinite(z))
        s = torch.where(bad, self.s0, s).to(torch.bfloat16)
        z = (-self.zp * s.float()) if self.fixed_zero else torch.where(bad, self.z0, z)
        return StoredWeight({**sw.tensors, "scales": s, "zeros": z.to(torch.bfloat16)}, sw.shape)


class _Decoder:
    """The float32 forward of a GQA + SwiGLU decoder whose linear weights come from `linear(module)`."""

    def __init__(self, cfg: ModelConfig, get: Callable[[str], torch.Tensor], has: Callable[[str], bool],
                 seq_len: int) -> None:
        self.cfg, self.get, self.has = cfg, get, has
        inv_freq, factor = rope_inv_freq(cfg)
        angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)  # [L, rot/2]
        self.cos, self.sin = factor * angles.cos(), factor * angles.sin()
        self.embed = get("model.embed_tokens.weight").float()
        self.head = get("lm_head.weight").float() if has("lm_head.weight") else self.embed
        self.final_norm = get("model.norm.weight").float()

    def layer(self, i: int, h: torch.Tensor, linear: Callable[[str], torch.Tensor],
              norms: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """Decoder layer i on the hidden states h [S, L, hidden] -> the next layer's input (`norms`: norm
        weights that replace the checkpoint's, AWQ's rewritten ones)."""
        cfg, p, norms = self.cfg, f"model.layers.{i}.", norms or {}
        a, m = f"{p}self_attn.", f"{p}mlp."

        def norm(name: str) -> torch.Tensor:
            return (norms[name] if name in norms else self.get(name)).float()

        x = rms_norm(h, norm(f"{p}input_layernorm.weight"), cfg.rms_norm_eps)
        attn = gqa_attention(cfg, self.get, self.has, a, x, tuple(linear(a + n) for n in _ATTN[:3]), self.cos,
                             self.sin)
        h = h + attn @ linear(a + "o_proj").t()
        if cfg.attention_bias and self.has(f"{a}o_proj.bias"):
            h = h + self.get(f"{a}o_proj.bias").float()
        x = rms_norm(h, norm(f"{p}post_attention_layernorm.weight"), cfg.rms_norm_eps)
        gate, up, down = (linear(m + n) for n in _MLP)
        return h + (F.silu(x @ gate.t()) * (x @ up.t())) @ down.t()

    def log_probs(self, h: torch.Tensor) -> torch.Tensor:
        """Next-token log-probabilities [L, vocab] float32 of one sequence's last hidden states h [L, hidden]."""
        return F.log_softmax(rms_norm(h, self.final_norm, self.cfg.rms_norm_eps) @ self.head.t(), dim=-1)


def kl_divergence(teacher: torch.Tensor, student: torch.Tensor) -> torch.Tensor:
    """Mean over rows of KL(teacher || student), both log-probabilities [L, vocab] (the teacher in any float
    dtype; `bench weights` scores formats by it too)."""
    t = teacher.float()
    return (t.exp() * (t - student)).sum(dim=-1).mean()


def tune_scales(cfg: ModelConfig, ids: torch.Tensor, get: Callable[[str], torch.Tensor], has: Callable[[str], bool],
                dense: Callable[[str], torch.Tensor], layers: list[dict[str, StoredWeight]], group_size: int,
                fixed_zero: bool, kept: Callable[[str], torch.Tensor],
                norms: list[dict[str, torch.Tensor]] | None = None, epochs: int = DEFAULT_TUNE_EPOCHS,
                lr: float = DEFAULT_TUNE_LR, seq_len: int = DEFAULT_TUNE_SEQ_LEN,
                progress: bool = False, seed: int = 0) -> TuneStats:
    """Tune the scales and zeros of `layers` (layer i's quantised linears, module -> `Int4Format` weight;
    replaced in place) on calibration ids [S, L] (module docstring). `get`/`has`: the checkpoint's dense
    tensors (embedding, norms, biases, LM head); `dense(module)`: a linear's dense float weight, for the
    teacher; `kept(module)`: the weight the quantised model runs for a linear not in `layers` (kept
    dense); `norms[i]`: layer i's norm weights rewritten by AWQ, which the quantised model runs instead."""
    started = time.perf_counter()
    if reason := untunable(cfg):
        raise WeightsError(f"INT4 scale tuning does not cover this model: {reason}")
    stats = TuneStats(epochs=epochs)
    if ids.shape[1] % seq_len == 0 and ids.shape[1] > seq_len:
        ids = ids.reshape(-1, seq_len)
    stats.sequences, stats.seq_len = ids.shape
    get = functools.cache(get)  # norms, biases, embedding: read from the checkpoint once, not every step
    model = _Decoder(cfg, get, has, ids.shape[1])
    groups = [{m: _Groups(sw, group_size, fixed_zero) for m, sw in layer.items()} for layer in layers]

    with torch.no_grad():  # the dense model's log-probs, one layer's dense weights at a time
        h = F.embedding(ids, model.embed)
        for i in range(cfg.num_layers):
            w = {f"model.layers.{i}.{part}.{n}": dense(f"model.layers.{i}.{part}.{n}").float()
                 for part, names in (("self_attn", _ATTN), ("mlp", _MLP)) for n in names}
            h = model.layer(i, h, w.__getitem__)
        teacher = [model.log_probs(h[j]).to(torch.bfloat16) for j in range(ids.shape[0])]
        del h, w

    held: dict[str, torch.Tensor] = {}  # the kept linears' dense weights, read once

    def linear(i: int, module: str) -> torch.Tensor:
        if module in groups[i]:
            return groups[i][module].weight()
        if module not in held:
            held[module] = kept(module)
        return held[module]

    def student(j: int) -> torch.Tensor:
        h = F.embedding(ids[j:j + 1], model.embed)
        for i in range(cfg.num_layers):
            h = model.layer(i, h, lambda module, i=i: linear(i, module), norms[i] if norms else None)
        return model.log_probs(h[0])

    def mean_kl() -> float:
        with torch.no_grad():
            return sum(float(kl_divergence(teacher[j], student(j))) for j in range(ids.shape[0])) / ids.shape[0]

    params = [t for g in groups for one in g.values() for t in (one.a, one.b) if t.requires_grad]
    stats.kl_start = mean_kl()
    optim = torch.optim.Adam(params, lr=lr)
    total = epochs * ids.shape[0]
    decay = torch.optim.lr_scheduler.CosineAnnealingLR(optim, max(total, 1))
    rng = torch.Generator().manual_seed(seed)
    with tqdm(total=total, desc="tune INT4 scales", unit="seq", disable=not progress) as bar:
        for _ in range(epochs):
            for j in torch.randperm(ids.shape[0], generator=rng).tolist():
                loss = kl_divergence(teacher[j], student(j))
                optim.zero_grad(set_to_none=True)
                loss.backward()
                optim.step()
                decay.step()
                stats.steps += 1
                bar.update()
                bar.set_postfix(kl=f"{float(loss.detach()):.4f}")
    tuned = [{m: one.stored(layer[m]) for m, one in g.items()} for layer, g in zip(layers, groups)]
    groups = [{m: _Groups(sw, group_size, fixed_zero) for m, sw in layer.items()} for layer in tuned]  # as stored
    stats.kl_end = mean_kl()
    if stats.kl_end < stats.kl_start:
        for layer, new in zip(layers, tuned):
            layer.update(new)
    else:  # no better on the calibration tokens: GPTQ's scales stay
        stats.kept_gptq = True
    stats.seconds = time.perf_counter() - started
    return stats


class TunedLayers:
    """A `LayerCalibrator` (`ops/calibration.py`) whose every layer is quantised first, the scales then
    tuned (`tune_scales`), the layers then handed out one by one as the calibrator hands them out
    (`layer`, `next_layer()`, `tensors`, `stats`). A compressed-tensors target's weights are unpacked
    for tuning (their grid's zero points kept) and packed again."""

    def __init__(self, calibrator: LayerCalibrator, ids: torch.Tensor, epochs: int = DEFAULT_TUNE_EPOCHS,
                 lr: float = DEFAULT_TUNE_LR, progress: bool = False) -> None:
        self.calibrator, self.ids, self.epochs, self.lr, self.progress = calibrator, ids, epochs, lr, progress
        self.layer = 0
        self.tensors: dict[str, torch.Tensor] = {}
        self.stats = calibrator.stats
        self._layers: list[dict[str, StoredWeight]] | None = None
        self._norms: list[dict[str, torch.Tensor]] = []

    def _run(self) -> None:
        cal = self.calibrator
        layers = []
        for _ in tqdm(range(cal.cfg.num_layers), desc="calibrate layers", unit="layer", disable=not self.progress):
            out = cal.next_layer()
            layers.append({m: cal.fmt.unpack(sw, m) if cal.packed else sw for m, sw in out.items()})
            self._norms.append(dict(cal.tensors))
        self.stats.tune = tune_scales(cal.cfg, self.ids, cal.get, cal.has, cal.weight, layers, cal.fmt.group_size,
                                      cal.packed, lambda m: cal.served(m).float(), self._norms, self.epochs,
                                      self.lr, progress=self.progress)
        self.stats.seconds += self.stats.tune.seconds
        self._layers = [{m: cal.fmt.pack(sw, m) if cal.packed else sw for m, sw in layer.items()}
                        for layer in layers]

    def next_layer(self) -> dict[str, StoredWeight]:
        """Layer `self.layer`'s quantised, tuned linears (module -> stored weight); `tensors`: its rewritten norms."""
        if self._layers is None:
            self._run()
        out, self.tensors = self._layers[self.layer], self._norms[self.layer]
        self._layers[self.layer] = {}
        self.layer += 1
        return out
