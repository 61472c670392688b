"""Tool-call parsers, one per model family, behind one registry.

    parser_class = tool_parser_for(config, override)   # from config.json, or `--tool-parser`
    parser = parser_class(tools)                        # one per response (`base.ToolParser`)

| name       | format                                                     | chosen for                     |
|------------|------------------------------------------------------------|--------------------------------|
| `hermes`   | `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` | Qwen2/2.5/3, Hermes, default   |
| `glm45`    | `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>` | GLM-4.5/4.6/4.7 (`glm4_moe`) |
| `kimi_k2`  | `<|tool_calls_section_begin|>...functions.NAME:IDX...`      | Kimi K2 (`kimi_k2`, DeepSeek V3 architecture with Kimi's config) |
"""

from __future__ import annotations

from typing import Any

from backend.errors import InvalidRequest
from gateway.tool_parsers.base import ContentDelta, ParsedCall, ParseEvent, ToolCallDelta, ToolParser
from gateway.tool_parsers.glm45 import Glm45Parser
from gateway.tool_parsers.hermes import HermesParser
from gateway.tool_parsers.kimi_k2 import KimiK2Parser

__all__ = ["TOOL_PARSERS", "tool_parser_for", "ToolParser", "ContentDelta", "ToolCallDelta", "ParsedCall",
           "ParseEvent"]

TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesParser, "glm45": Glm45Parser, "kimi_k2": KimiK2Parser}

_BY_MODEL_TYPE = {"glm4_moe": "glm45", "kimi_k2": "kimi_k2"}
_BY_ARCHITECTURE = {"Glm4MoeForCausalLM": "glm45", "KimiK2ForCausalLM": "kimi_k2"}


def tool_parser_for(config: dict[str, Any], override: str | None = None) -> type[ToolParser]:
    """The parser for a model: `override` (a `TOOL_PARSERS` name) if given, else from its
    `config.json` (`model_type`, `architectures[0]`), else `hermes`."""
    if override is not None:
        if override not in TOOL_PARSERS:
            raise InvalidRequest(f"unknown tool parser {override!r}; known: {sorted(TOOL_PARSERS)}",
                                 field="tool_parser")
        return TOOL_PARSERS[override]
    archs = config.get("architectures") or [""]
    name = _BY_MODEL_TYPE.get(str(config.get("model_type")), _BY_ARCHITECTURE.get(str(archs[0]), "hermes"))
    return TOOL_PARSERS[name]
