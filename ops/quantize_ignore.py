"""What `edgeserve quantize --to int4` leaves out of INT4: the `--ignore` list, its presets and its matching.

An ignore list is compressed-tensors' ``ignore`` (the list a pack-quantized
checkpoint's ``quantization_config`` carries, which vLLM and SGLang read): each
entry is either an exact module name (``lm_head``) or ``re:`` and a Python regex
that must match the module name from its start (`re.match`, not `re.search`:
``re:.*mlp\\.gate$`` needs its leading ``.*``). Names are module names, without a
tensor suffix: ``model.layers.3.mlp.experts.7.down_proj``, not ``...down_proj.weight``.
A checkpoint that keeps its text model under a prefix (Kimi K2.5/K2.6:
``language_model.``) may spell names with or without it; `is_ignored` tries both.

**Defaults** (`DEFAULT_IGNORE`, preset ``default``), each kept in its source format:

- ``lm_head``: the last matrix before the logits. Its error goes straight into every
  token's probabilities, with no later layer to average it out, and it is one
  vocab x hidden matrix (1.3% of a 744B-parameter MoE's bytes), so INT4 saves little.
- ``re:.*embed_tokens$``: a table lookup, not a GEMM; INT4 would not speed decode
  and no pack-quantized loader reads an INT4 embedding.
- ``re:.*norm$``: RMSNorm/LayerNorm weights (and the DSA indexer's k_norm bias):
  vectors of a few thousand values per layer that scale every activation.
- ``re:.*mlp\\.gate$``: the MoE router [experts, hidden], with its
  e_score_correction_bias. The runtime computes routing in float32
  (`backend/moe.py`): a rounding error that reorders two expert scores sends the
  token to a different expert, a discrete change no later layer corrects. 0.2 MB
  per layer.
- ``re:.*kv_b_proj$`` (MLA models): dequantised to a dense matrix at load whatever
  its stored format, as vLLM and SGLang do, because weight absorption splits it
  into W_UK and W_UV. INT4 would save disk, not serving memory, and cost accuracy.
- ``re:.*\\.indexer\\..*`` (GLM-5's DSA indexer: wq_b, wk, weights_proj): it picks the
  top-k keys each query attends to, so its errors change which tokens are seen at
  all; GLM-5-FP8 already keeps weights_proj dense and vLLM replicates the indexer
  on every GPU. 0.1% of GLM-5's bytes.
- ``re:.*eh_proj$`` (the multi-token-prediction layer's input projection): vLLM and
  SGLang build it as a plain `torch.nn.Linear`, which takes no quantised weight, so a
  packed eh_proj would not load there. 75M parameters.

Norms, the embedding and the router are not linears of the checkpoint layout, so
`edgeserve quantize` would not convert them anyway; the default list names them so
that the ignore list written into config.json states the whole decision to other
loaders.

**Preset ``kimi``** (`KIMI_IGNORE`): the defaults plus what Kimi K2-Thinking /
K2.5 / K2.6's native INT4 release leaves in BF16, so only the routed experts are
INT4: ``re:.*self_attn.*`` (all attention, MLA and the indexer), ``re:.*shared_experts.*``
and ``re:.*mlp\\.(gate|up|gate_up|down)_proj.*`` (the dense first layers' MLP). The
routed experts hold ~97% of such a model's bytes and are each read by 8 of ~256
tokens' worth of routing, so they carry nearly all of the saving; attention and the
shared expert run for every token and are where INT4 error costs most. This preset
is also what reproduces the public 705 -> 421 GB figure (`ops/quantize_plan.py`).

**Fused shards must agree.** vLLM runs q/k/v, gate/up, MLA's q_a_proj with
kv_a_proj_with_mqa, and all routed experts of a layer as one fused GEMM each, with
one quantisation scheme, and refuses a checkpoint whose shards differ.
`check_fused_consistency` finds such a list before anything is written.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence

from backend.compressed_tensors import matches_any
from backend.errors import InvalidRequest

__all__ = ["DEFAULT_IGNORE", "KIMI_IGNORE", "IGNORE_PRESETS", "ignore_patterns", "validate_patterns",
           "is_ignored", "ignore_matcher", "fused_group", "check_fused_consistency"]

DEFAULT_IGNORE: tuple[str, ...] = (
    "lm_head",
    r"re:.*embed_tokens$",
    r"re:.*norm$",
    r"re:.*mlp\.gate$",
    r"re:.*kv_b_proj$",
    r"re:.*\.indexer\..*",
    r"re:.*eh_proj$",
)
KIMI_IGNORE: tuple[str, ...] = DEFAULT_IGNORE + (  # the last three are Kimi's release's own entries
    r"re:.*self_attn.*",
    r"re:.*shared_experts.*",
    r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
)
IGNORE_PRESETS: dict[str, tuple[str, ...]] = {"default": DEFAULT_IGNORE, "kimi": KIMI_IGNORE}


def validate_patterns(patterns: Iterable[str]) -> tuple[str, ...]:
    """The patterns as a tuple, after checking each: a non-empty name, or ``re:`` and a regex that
    compiles. InvalidRequest names the bad entry."""
    out = []
    for p in patterns:
        if not isinstance(p, str) or not p.strip() or p == "re:":
            raise InvalidRequest(f"--ignore entry {p!r} is empty; give a module name or re:<regex>", ignore=p)
        if p.startswith("re:"):
            try:
                re.compile(p[3:])
            except re.error as exc:
                raise InvalidRequest(f"--ignore entry {p!r} is not a valid regex: {exc}", ignore=p) from exc
        out.append(p)
    return tuple(out)


def ignore_patterns(preset: str = "default", extra: Sequence[str] = ()) -> tuple[str, ...]:
    """The ignore list of `preset` ("default", "kimi" or "none") followed by `extra` patterns
    (each checked, duplicates dropped, order kept)."""
    if preset != "none" and preset not in IGNORE_PRESETS:
        raise InvalidRequest(f"unknown ignore preset {preset!r}; known: {', '.join(IGNORE_PRESETS)}, none",
                             preset=preset)
    base = () if preset == "none" else IGNORE_PRESETS[preset]
    return tuple(dict.fromkeys(base + validate_patterns(extra)))


def is_ignored(name: str, patterns: Sequence[str], prefix: str = "") -> bool:
    """Whether module `name` stays out of INT4 under `patterns` (exact names, or ``re:`` regexes
    matched from the start of the name); with `prefix`, ``prefix + name`` is tried too."""
    if matches_any(name, patterns):
        return True
    return bool(prefix) and matches_any(prefix + name, patterns)


def ignore_matcher(patterns: Sequence[str], prefix: str = "") -> Callable[[str], bool]:
    """`is_ignored` for one list, compiled once (the regexes as one alternation): for the tens of
    thousands of expert names of a large MoE."""
    names = {p for p in validate_patterns(patterns) if not p.startswith("re:")}
    regexes = [p[3:] for p in patterns if p.startswith("re:")]
    try:
        combined = re.compile("|".join(f"(?:{r})" for r in regexes)) if regexes else None
    except re.error:  # e.g. a global inline flag that only works at the start of its own pattern
        return lambda name: is_ignored(name, patterns, prefix)

    def ignored(name: str) -> bool:
        return any(n in names or (combined is not None and combined.match(n) is not None)
                   for n in ((name, prefix + name) if prefix else (name,)))
    return ignored


_FUSED = (  # (regex over a module name, what vLLM fuses it into)
    (re.compile(r"(.*\.self_attn)\.(q|k|v)_proj$"), r"\1.qkv_proj"),
    (re.compile(r"(.*\.self_attn)\.(q_a_proj|kv_a_proj_with_mqa)$"), r"\1.fused_qkv_a_proj"),
    (re.compile(r"(.*\.mlp\.experts)\.\d+\.(gate|up|down)_proj$"), r"\1"),
    (re.compile(r"(.*)\.(gate|up)_proj$"), r"\1.gate_up_proj"),
)


def fused_group(name: str) -> str | None:
    """The fused module vLLM loads linear `name` into (``...self_attn.qkv_proj``,
    ``...mlp.gate_up_proj``, ``...mlp.experts``, ...), or None when it runs alone."""
    for pattern, repl in _FUSED:
        if pattern.match(name):
            return pattern.sub(repl, name)
    return None


def check_fused_consistency(modules: Iterable[str], patterns: Sequence[str], prefix: str = "") -> None:
    """Raise InvalidRequest when `patterns` ignore some but not all shards of one fused module
    among linear `modules` (vLLM would refuse the checkpoint at load)."""
    seen: dict[str, tuple[bool, str]] = {}
    for name in modules:
        group = fused_group(name)
        if group is None:
            continue
        ignored = is_ignored(name, patterns, prefix)
        if group in seen and seen[group][0] != ignored:
            other = seen[group][1]
            kept, dropped = (other, name) if ignored else (name, other)
            raise InvalidRequest(f"the --ignore list keeps {dropped} out of INT4 but quantises {kept}; vLLM runs "
                                 f"both as one fused module ({group}) with one format: ignore all of its shards "
                                 f"or none", group=group)
        seen.setdefault(group, (ignored, name))
