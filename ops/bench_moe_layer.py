"""One MoE layer's time per expert path (grouped, loop, int4 loop, transformers) at 1-256 tokens.

A random Glm4Moe-style layer (defaults: hidden 1024, 64 experts, top-8, expert
intermediate 512, one shared expert, 8 groups / 4 kept, float32). Each path runs the
whole `MoEBlock` (router, routed experts, shared expert); ``transformers`` is
`Glm4MoeMoE.forward` on the same weights. Paths are interleaved and the median taken,
so a noisy neighbour hits them alike. JSON: ``{"moe_layer_ms": {path: {tokens: ms}}}``.

Run: ``python -m ops.bench_moe_layer [--quick] [--threads N] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

__all__ = ["add_arguments", "run", "moe_layer_ms"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--inter", type=int, default=512, help="moe_intermediate_size")
    p.add_argument("--tokens", default="1,8,32,256")
    p.add_argument("--threads", type=int, default=None)


def moe_layer_ms(hidden: int, experts: int, top_k: int, inter: int, tokens: list[int], reps: int,
                 seed: int = 0) -> dict[str, dict[int, float]]:
    """Median ms of one layer per path and token count."""
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE

    from backend.moe import MoEBlock, MoEConfig
    from backend.weight_formats import DenseFormat, Int4Format

    torch.manual_seed(seed)
    groups = 8 if experts % 8 == 0 and experts >= 16 else 1
    hf_cfg = Glm4MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, n_routed_experts=experts,
                           num_experts_per_tok=top_k, n_group=groups, topk_group=max(1, groups // 2),
                           n_shared_experts=1, routed_scaling_factor=2.5)
    hf = Glm4MoeMoE(hf_cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * hidden ** -0.5)
        hf.gate.e_score_correction_bias.copy_(torch.rand(experts) * 0.01)
    s = hf.shared_experts
    args = (hf.gate.weight.detach(), hf.gate.e_score_correction_bias, hf.experts.gate_up_proj.detach(),
            hf.experts.down_proj.detach(), torch.cat([s.gate_proj.weight, s.up_proj.weight]).detach(),
            s.down_proj.weight.detach(), MoEConfig.from_hf(hf_cfg.to_dict()))
    dense = MoEBlock.build(*args, DenseFormat(torch.float32), torch.float32)
    int4 = MoEBlock.build(*args, Int4Format(128), torch.float32)
    paths: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "loop": lambda x: dense(x, path="loop"), "int4_loop": int4, "transformers": lambda x: hf(x[None])}
    if "grouped" in dense.experts.paths:
        paths = {"grouped": lambda x: dense(x, path="grouped"), **paths}
    out: dict[str, dict[int, float]] = {name: {} for name in paths}
    with torch.no_grad():
        for t in tokens:
            x = torch.randn(t, hidden)
            times: dict[str, list[float]] = {name: [] for name in paths}
            for f in paths.values():
                f(x)  # warm up
            for _ in range(reps if t < 256 else max(2, reps // 4)):
                for name, f in paths.items():
                    start = time.perf_counter()
                    f(x)
                    times[name].append((time.perf_counter() - start) * 1e3)
            for name in paths:
                out[name][t] = statistics.median(times[name])
    return out


def run(args: argparse.Namespace) -> int:
    from ops.bench import provenance, write_report

    if args.threads:
        torch.set_num_threads(args.threads)
    tokens = [int(t) for t in args.tokens.split(",")]
    reps = 3 if args.quick else 15
    res = moe_layer_ms(args.hidden, args.experts, args.top_k, args.inter, tokens, reps)
    print(f"\nMoE layer ms (median of {reps}): hidden {args.hidden}, {args.experts} experts, top-{args.top_k}, "
          f"inter {args.inter}, 1 shared, threads={torch.get_num_threads()}")
    print(f"{'path':<14}" + "".join(f"{t:>10}" for t in tokens))
    for name, row in res.items():
        print(f"{name:<14}" + "".join(f"{row[t]:>10.2f}" for t in tokens))
    write_report(args.json_path, {"moe_layer_ms": res, "threads": torch.get_num_threads(),
                                  "config": {"hidden": args.hidden, "experts": args.experts, "top_k": args.top_k,
                                             "inter": args.inter, "shared": 1},
                                  **provenance()})
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", dest="json_path", default="bench-results/moe-layer.json")
    add_arguments(p)
    return run(p.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
