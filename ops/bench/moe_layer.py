"""One MoE layer's time per expert path (grouped, loop, their INT4 twins, transformers): `bench moe`'s layer part.

A random Glm4Moe MoE layer of the given `Glm4MoeConfig` (router with correction
bias and group-limited top-k, routed experts, shared experts; float32). Each of our
paths runs the whole `MoEBlock` (router, routed experts, shared expert):
``grouped`` and ``loop`` on float32 experts (`backend/moe_experts.py`; grouped only
where `torch._grouped_mm` runs on this torch and shape; up to the C GEMV's row limit the
grouped path is one C call, `kernels/cpu_moe_experts.py`), ``int4_loop`` and
``int4_grouped`` (the C call, where it builds) on INT4 experts (group 128);
``transformers`` is `Glm4MoeMoE.forward` holding the same float32 weights, with the
experts implementation a loaded `Glm4MoeForCausalLM` would use
(`hf_experts_implementation`: ``grouped_mm`` on a torch that has it). Every path
gets the same input [T, H]; the paths are interleaved (one call each per round, the
order reversed each round) and the median taken, so a noisy neighbour hits them alike.
The command that prints and records it is `ops/bench/moe.py`.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable

import torch

__all__ = ["moe_layer_ms", "hf_experts_implementation", "LAYER_PATHS"]

# in table order; the grouped ones may be absent
LAYER_PATHS = ("grouped", "loop", "int4_grouped", "int4_loop", "transformers")


def hf_experts_implementation(hf_cfg) -> str:
    """The experts implementation a `Glm4MoeForCausalLM` of `hf_cfg` runs (transformers picks
    ``grouped_mm`` where torch can dispatch it, else ``eager``), unless the config names one."""
    from transformers import Glm4MoeForCausalLM

    hf_cfg = copy.deepcopy(hf_cfg)
    with torch.device("meta"):  # nothing allocated; the constructor resolves the implementation
        Glm4MoeForCausalLM(hf_cfg)
    return hf_cfg._experts_implementation


def moe_layer_ms(hf_cfg, tokens: list[int], reps: int, seed: int = 0) -> dict[str, dict[int, float]]:
    """Median milliseconds of one MoE layer per path and token count T: ``{path: {T: ms}}``.

    `hf_cfg` is a `transformers.Glm4MoeConfig` (hidden_size, n_routed_experts,
    num_experts_per_tok, moe_intermediate_size, n_shared_experts, n_group, topk_group,
    norm_topk_prob, routed_scaling_factor are used). Weights are random with std
    fan_in^-0.5, the correction bias uniform in [0, 0.01); inputs are fresh standard
    normals per T. T = 256 gets a quarter of `reps` (at least 2): it is the slow one."""
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE

    from backend.moe import MoEBlock, MoEConfig
    from backend.weight_formats import DenseFormat, Int4Format

    hf_cfg = copy.deepcopy(hf_cfg)
    hf_cfg._experts_implementation = hf_experts_implementation(hf_cfg)
    torch.manual_seed(seed)
    hidden, experts = hf_cfg.hidden_size, hf_cfg.n_routed_experts
    hf = Glm4MoeMoE(hf_cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
        hf.gate.e_score_correction_bias.copy_(torch.rand(experts) * 0.01)
    s = hf.shared_experts
    args = (hf.gate.weight.detach(), hf.gate.e_score_correction_bias, hf.experts.gate_up_proj.detach(),
            hf.experts.down_proj.detach(), torch.cat([s.gate_proj.weight, s.up_proj.weight]).detach(),
            s.down_proj.weight.detach(), MoEConfig.from_hf(hf_cfg.to_dict()))
    dense = MoEBlock.build(*args, DenseFormat(torch.float32), torch.float32)
    int4 = MoEBlock.build(*args, Int4Format(128), torch.float32)
    paths: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "loop": lambda x: dense(x, path="loop"), "int4_loop": lambda x: int4(x, path="loop"),
        "transformers": lambda x: hf(x[None])}
    if "grouped" in int4.experts.paths:
        paths = {"int4_grouped": lambda x: int4(x, path="grouped"), **paths}
    if "grouped" in dense.experts.paths:
        paths = {"grouped": lambda x: dense(x, path="grouped"), **paths}
    out: dict[str, dict[int, float]] = {name: {} for name in paths}
    with torch.no_grad():
        for t in tokens:
            x = torch.randn(t, hidden)  # [T, H]
            times: dict[str, list[float]] = {name: [] for name in paths}
            for f in paths.values():
                f(x)  # warm up
            order = list(paths.items())
            for _ in range(reps if t < 256 else max(2, reps // 4)):
                for name, f in order:
                    start = time.perf_counter()
                    f(x)
                    times[name].append((time.perf_counter() - start) * 1e3)
                order.reverse()
            for name in paths:
                out[name][t] = statistics.median(times[name])
    return out
