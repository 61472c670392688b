"""Tensor parallelism over quantised checkpoints on gloo (CPU): each rank reads only its slices of the
stored tensors (FP8 block scales, INT4 groups) and the group's greedy output equals one process's,
logits within 1e-4 in float32 compute.

- DeepseekV3 (MLA + MoE) stored FP8 block-scaled, as DeepSeek-V3 ships: 16 x 16 blocks at TP 2 and
  TP 2 + EP 2 (kv_b_proj's per-rank rows [56, 112) and o_proj's columns [24, 48) start inside a block),
  and 128 x 128 blocks at TP 2 (every rank-1 range starts inside a block);
- Kimi K2.x: the DeepseekV3 text model under `language_model.` with compressed-tensors pack-quantized
  INT4 routed experts (Kimi's ignore list: attention, shared experts and the dense layer BF16), at
  TP 2 + EP 2 (whole experts: the INT4 GEMM runs as stored) and at TP 2 (experts split by their
  intermediate rows, on group boundaries);
- a Llama written by `edgeserve quantize` in our INT4 format (group 32) at TP 2.

Where the runtime keeps INT4 on CPU, its GEMM takes bfloat16 activations and returns bfloat16 rows
(`backend/linear.py`), so a row-parallel split rounds each rank's partial sum where one process rounds
the whole. So the 1e-4 parity of a split INT4 weight runs the same stored codes dequantised exactly
into float32 (`--prefill-weights/--decode-weights fp32`); the INT4 GEMM itself is checked at TP 2 + EP 2
(whole experts: 1e-4) and on Kimi's experts at TP 2 within a bfloat16-sized bound (measured 1.7e-3).
Not on the tiny Llama: its near-uniform random logits (0.02 init) let bf16 rounding flip an argmax.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from backend.compressed_tensors import PackQuantizedWriter
from backend.config import load_config
from backend.distributed.collectives import Collectives
from backend.distributed.sharding import LEADER_ONLY, ShardPlan, TensorSlice
from backend.errors import WeightsError
from backend.layers.loader import WeightLoader
from backend.model import load_model
from backend.weight_formats import Fp8Format, Int4Format
from backend.weights import CheckpointReader
from kernels import cpu_gemv_int4
from ops.quantize import quantize_checkpoint
from ops.quantize_ignore import KIMI_IGNORE
from tests.backend.test_checkpoint_prefix import wrap
from tests.backend.test_tp import Run, generate, prompts_for
from tests.backend.tiny_mla_models import write_tiny_deepseek_v3
from tests.backend.tiny_models import write_tiny_model

FP32 = dict(prefill_weights="fp32", decode_weights="fp32")
BF16_ATOL = 5e-2  # INT4 GEMM outputs rounded to bfloat16 per rank (see the module docstring)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _units(suffix: str, dim: int, block: tuple[int, int], group: int) -> int | None:
    """Logical rows (dim 0) or columns (dim 1) of W per element of a stored tensor along `dim`; None:
    a tensor read whole (weight_shape)."""
    if suffix == "weight_shape":
        return None
    if suffix == "weight_scale_inv":
        return block[dim]
    if dim == 0:
        return 1
    return {"weight": 1, "qweight": 2, "weight_packed": 8, "scales": group, "zeros": group,
            "weight_scale": group}[suffix]


def expected_bytes(path: Path, world: int, expert_parallel: bool = False, rank: int = 0) -> int:
    """Bytes rank `rank` should read from a (quantised) checkpoint: for every tensor of the experts it
    holds, the stored elements the plan's logical rows or columns [a, b) of its linear touch along the
    split dim (ceil(b / u) - a // u of them, u the logical rows/columns per stored element: 1, 2 codes
    per byte, 8 per int32, a group, a scale block), everything of a replicated tensor."""
    cfg = load_config(path)
    plan = ShardPlan(cfg, rank, world, expert_parallel)
    ckpt = CheckpointReader(path, cfg.checkpoint_prefix)
    qc = cfg.quantization or {}
    block = tuple(qc.get("weight_block_size", (128, 128)))
    group = int(qc.get("group_size") or next(iter(qc.get("config_groups", {"": {"weights": {"group_size": 0}}})
                                                  .values()))["weights"]["group_size"])
    total = 0
    for name in ckpt.names():
        expert = re.search(r"mlp\.experts\.(\d+)\.", name)
        if expert is not None and int(expert.group(1)) not in plan.experts:
            continue  # another expert-parallel rank's expert: never read
        module, suffix = name.rsplit(".", 1)
        spec = ckpt.spec(name)
        if f"{module}.qweight" in ckpt:
            q = ckpt.spec(f"{module}.qweight").shape
            how = plan.slice_of(f"{module}.weight", (q[0], 2 * q[1]))
        elif f"{module}.weight_packed" in ckpt:
            s = ckpt.spec(f"{module}.weight_scale").shape
            how = plan.slice_of(f"{module}.weight", (s[0], s[1] * group))
        elif suffix == "weight_scale_inv":
            how = plan.slice_of(f"{module}.weight", ckpt.spec(f"{module}.weight").shape)
        else:  # a dense tensor: sliced (or not) as stored
            how = plan.slice_of(name, spec.shape)
        unit = _units(suffix, how.dim, block, group) if isinstance(how, TensorSlice) else None
        if unit is None:
            total += 0 if how == LEADER_ONLY and rank else spec.nbytes
        else:
            total += spec.nbytes // spec.shape[how.dim] * (_ceil(how.stop, unit) - how.start // unit)
    return total


def check(path: Path, world: int, *, expert_parallel: bool = False, atol: float = 1e-4, **engine: object) -> Run:
    prompts = prompts_for(320, seed=6)
    ref = generate(path, 1, prompts, **engine)
    got = generate(path, world, prompts, expert_parallel=expert_parallel, **engine)
    assert got.outputs == ref.outputs
    diff = max((a - b).abs().max().item() for a, b in zip(ref.logits, got.logits))
    print(f"{path.name} TP {world}{' EP' if expert_parallel else ''} {engine}: max |logit diff| {diff:.2e}, "
          f"rank 0 read {got.bytes_read} of {ref.bytes_read} bytes")
    assert diff <= atol, diff
    assert got.bytes_read == expected_bytes(path, world, expert_parallel)
    assert got.bytes_read < 0.8 * ref.bytes_read
    for rank in range(1, world):  # the followers' shards, loaded here as that rank (loading makes no collective)
        shard = load_model(path, group=Collectives(rank, world), expert_parallel=expert_parallel, **engine)
        assert shard.bytes_read == expected_bytes(path, world, expert_parallel, rank)
    return got


# ---------------------------------------------------------------- FP8 block-scaled DeepseekV3

def write_fp8_deepseek_v3(path: Path, block: tuple[int, int], seed: int = 3) -> Path:
    """A tiny DeepseekV3 with every `*_proj` weight of the layers in e4m3 with `block` scales (other
    than 1), as the FP8 releases store them; config.json's quantization_config says so."""
    write_tiny_deepseek_v3(path, seed=seed)
    fmt = Fp8Format(block)
    f = path / "model.safetensors"
    out = {}
    for name, w in load_file(f).items():
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            sw = fmt.quantize(w * 3.0)
            out[name], out[name[: -len("weight")] + "weight_scale_inv"] = (sw.tensors["weight"],
                                                                          sw.tensors["weight_scale_inv"])
        else:
            out[name] = w
    save_file(out, f, metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = fmt.quantization_config()
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_fp8_deepseek_v3(tmp_path_factory.mktemp("fp8") / "m", (16, 16))


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "tp2-ep2"])
def test_fp8_deepseek_v3_block16(fp8_dir: Path, expert_parallel: bool) -> None:
    check(fp8_dir, 2, expert_parallel=expert_parallel)


def test_fp8_deepseek_v3_block128_every_cut_inside_a_block(tmp_path: Path) -> None:
    check(write_fp8_deepseek_v3(tmp_path / "m", (128, 128), seed=8), 2)


# ---------------------------------------------------------------- Kimi K2.x: compressed-tensors INT4 experts

@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Kimi K2.x in small: a DeepseekV3 (routed experts 64 rows, so a TP 2 share is two groups of 32)
    quantised by `edgeserve quantize` to pack-quantized INT4 with Kimi's ignore list, then wrapped as
    Kimi_K25ForConditionalGeneration (text model under `language_model.`, a vision tower beside it)."""
    root = tmp_path_factory.mktemp("kimi")
    plain = write_tiny_deepseek_v3(root / "plain", seed=9, moe_intermediate_size=64)
    quantize_checkpoint(plain, root / "ct", PackQuantizedWriter(32, KIMI_IGNORE), method="rtn", progress=False)
    kimi = wrap(root / "ct", root / "kimi", shards=2)
    raw = json.loads((kimi / "config.json").read_text())
    raw["architectures"] = ["Kimi_K25ForConditionalGeneration"]
    (kimi / "config.json").write_text(json.dumps(raw))
    packed = [n for n in CheckpointReader(kimi, "language_model.").names() if n.endswith("weight_packed")]
    assert packed and all(".mlp.experts." in n for n in packed)  # only the routed experts are INT4
    return kimi


def test_kimi_int4_experts_tp2_ep2(kimi_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whole experts per rank: the INT4 GEMM computes each expert exactly as one process does.

    The dense float32 layers run torch's GEMM here (EDGESERVE_F32_GEMV=0, inherited by the ranks): the INT4
    experts round their input to bfloat16, so the 1e-4 below holds only while the experts' inputs are the same
    bits in both layouts, which torch's GEMM gave and the C GEMV does not (measured: logits 6.8e-4 apart with it,
    though every call of it was within 1.2e-7 of sum |x w| of float64 and the float32-experts run below agrees to
    4e-7; the likely source is the row-parallel layers' two K halves summed apart)."""
    monkeypatch.setenv("EDGESERVE_F32_GEMV", "0")
    check(kimi_dir, 2, expert_parallel=True)


def test_followers_take_rank_0s_timed_int4_choice(kimi_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's probe times the INT4 C kernel faster; the followers', on their own (here their environment, which
    they inherit), would keep torch's INT4 GEMM. The group runs rank 0's choice (`kernel_choices.py`), so the logits
    agree as closely as above: with the followers on torch's op they came out 7.6e-4 apart."""
    monkeypatch.setenv("EDGESERVE_F32_GEMV", "0")
    monkeypatch.setenv("EDGESERVE_INT4_GEMV", "0")  # what a follower would take on its own
    monkeypatch.setattr(cpu_gemv_int4, "pays", cpu_gemv_int4.available)  # rank 0's probe: the C kernel
    check(kimi_dir, 2, expert_parallel=True)


def test_kimi_int4_experts_tp2(kimi_dir: Path) -> None:
    """Experts split by intermediate rows (down_proj's columns on group boundaries)."""
    check(kimi_dir, 2, **FP32)
    check(kimi_dir, 2, atol=BF16_ATOL)  # the INT4 GEMM as stored: bf16 partial sums


def test_int4_column_split_that_cuts_a_group_is_refused(kimi_dir: Path, tmp_path: Path) -> None:
    """Experts of 32 rows in groups of 32 cannot split over 2 ranks without expert parallelism."""
    plain = write_tiny_deepseek_v3(tmp_path / "plain", seed=9)
    quantize_checkpoint(plain, tmp_path / "ct", PackQuantizedWriter(32, KIMI_IGNORE), method="rtn", progress=False)
    cfg = load_config(tmp_path / "ct")
    loader = WeightLoader(tmp_path / "ct", cfg, torch.float32, plan=ShardPlan(cfg, 1, 2))
    with pytest.raises(WeightsError, match=r"columns \[16, 32\).*cut INT4 groups of 32"):
        loader.read("model.layers.1.mlp.experts.0.down_proj")
    loader = WeightLoader(tmp_path / "ct", cfg, torch.float32, plan=ShardPlan(cfg, 1, 2, expert_parallel=True))
    assert loader.read("model.layers.1.mlp.experts.4.down_proj")[1].shape == (64, 32)  # a whole expert


# ---------------------------------------------------------------- our INT4 format, from `edgeserve quantize`

def test_int4_llama_from_edgeserve_quantize_tp2(tmp_path: Path) -> None:
    """hidden 128 / 8 heads and intermediate 128: each rank's o_proj and down_proj columns are two
    groups of 32."""
    plain = write_tiny_model(tmp_path / "plain", "llama", seed=5, hidden_size=128, num_attention_heads=8,
                             num_key_value_heads=2)
    out = tmp_path / "int4"
    quantize_checkpoint(plain, out, Int4Format(32), method="rtn", progress=False)
    assert load_config(out).quantization["quant_method"] == "edgeserve_int4"
    check(out, 2, **FP32)
