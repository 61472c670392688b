"""Reasoning parsers, one small rule per model family, behind one registry.

    parser_class = reasoning_parser_for(config, override)   # from config.json, or `--reasoning-parser`
    parser = parser_class(in_think=..., tool_start=...)      # one per response (`base.ReasoningParser`)

| name          | rule                                                            | chosen from config for |
|---------------|-----------------------------------------------------------------|------------------------|
| `deepseek_r1` | always starts inside `<think>`; no `</think>`: all reasoning     | never (flag only)      |
| `qwen3`       | `<think>...</think>` first, or opened by the template           | `qwen3`, `qwen3_moe`   |
| `glm45`       | as qwen3; a `<tool_call>` also ends reasoning                    | `glm4_moe`             |
| `kimi_k2`     | as qwen3; `<|tool_calls_section_begin|>` also ends reasoning     | `kimi_k2`, `kimi_k25`  |

A config chooses a rule only where the family's models all write `<think>` blocks this way
and the rule does nothing to output without one; anything else is off unless the flag says.
"""

from __future__ import annotations

from typing import Any

from backend.errors import InvalidRequest
from gateway.reasoning_parsers.base import ReasoningDelta, ReasoningEvent, ReasoningParser, split_reasoning
from gateway.reasoning_parsers.deepseek_r1 import DeepSeekR1ReasoningParser
from gateway.reasoning_parsers.glm45 import Glm45ReasoningParser
from gateway.reasoning_parsers.kimi_k2 import KimiK2ReasoningParser
from gateway.reasoning_parsers.qwen3 import Qwen3ReasoningParser

__all__ = ["REASONING_PARSERS", "reasoning_parser_for", "ReasoningParser", "ReasoningDelta", "ReasoningEvent",
           "split_reasoning"]

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser, "qwen3": Qwen3ReasoningParser, "glm45": Glm45ReasoningParser,
    "kimi_k2": KimiK2ReasoningParser}

_BY_MODEL_TYPE = {"qwen3": "qwen3", "qwen3_moe": "qwen3", "glm4_moe": "glm45", "kimi_k2": "kimi_k2",
                  "kimi_k25": "kimi_k2"}
_BY_ARCHITECTURE = {"Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3", "Glm4MoeForCausalLM": "glm45"}


def reasoning_parser_for(config: dict[str, Any], override: str | None = None) -> type[ReasoningParser] | None:
    """The reasoning rule for a model: `override` (a `REASONING_PARSERS` name, or "none") if given, else
    from its `config.json` where that is certain (table above), else None (reasoning is not split)."""
    if override is not None:
        if override == "none":
            return None
        if override not in REASONING_PARSERS:
            raise InvalidRequest(f"unknown reasoning parser {override!r}; known: {sorted(REASONING_PARSERS)}",
                                 field="reasoning_parser")
        return REASONING_PARSERS[override]
    archs = config.get("architectures") or [""]
    name = _BY_MODEL_TYPE.get(str(config.get("model_type")), _BY_ARCHITECTURE.get(str(archs[0])))
    return REASONING_PARSERS[name] if name else None
