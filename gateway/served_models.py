"""Models the gateway serves: names and aliases, tokenizer, chat template, context length, and
the tool-call and reasoning parsers of the model's family (`tool_parsers/`, `reasoning_parsers/`, from
its config or the route's `tool_parser` / `reasoning_parser`).

The gateway owns the text side of a request: it renders the chat template,
tokenises, checks the context length, and detokenises what comes back, so
workers only ever see token ids. Control tokens come only from the template:
special-token text in messages stays text (`Tokenizer.encode_chat`).

Encoding holds the CPU for about 0.3 us a character (1 ms at 3 KB of text on the
development machine), while a hop to a thread costs about 60 us, so the async
entry points encode prompts of `OFFLOAD_CHARS` or more in a thread (the tokenizer
releases the GIL) and smaller ones inline.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from backend.errors import ModelLoadError, ModelNotFound, PromptTooLong
from backend.tokenizer import Tokenizer
from gateway.config import ModelRoute
from gateway.reasoning_parsers import ReasoningParser, reasoning_parser_for
from gateway.tool_parsers import ToolParser, tool_parser_for

__all__ = ["ServedModel", "ModelCatalog", "OFFLOAD_CHARS"]

OFFLOAD_CHARS = 4096  # ~1.3 ms of encoding, some 20 thread hops


class ServedModel:
    """One model: `name` is what workers call it; `names` everything a client may say."""

    def __init__(self, route: ModelRoute) -> None:
        self.route = route
        self.name = route.name
        self.names = [route.name, *route.aliases]
        self.tokenizer = Tokenizer.from_model_dir(route.model_dir)
        self.tokenizer.encode("", split_special_tokens=True)  # build its plain-text copy now, not on a request
        config_path = Path(route.model_dir) / "config.json"
        try:
            config = json.loads(config_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelLoadError(f"cannot read {config_path}: {exc}") from exc
        self.max_model_len = int(route.max_model_len or config.get("max_position_embeddings", 2048))
        self.tool_parser: type[ToolParser] = tool_parser_for(config, route.tool_parser)
        self.reasoning_parser: type[ReasoningParser] | None = reasoning_parser_for(config, route.reasoning_parser)

    def prompt_opens_think(self, prompt_ids: list[int]) -> bool:
        """Whether the prompt ends inside a think block the template opened (`<think>` last, with only
        whitespace after it): the output then starts as reasoning. False without a reasoning parser."""
        if self.reasoning_parser is None:
            return False
        tail = self.tokenizer.decode(prompt_ids[-8:], skip_special_tokens=False)
        return tail.rstrip().endswith(self.reasoning_parser.START)

    def chat_prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                        cache_namespace: str | None = None) -> list[int]:
        """Token ids of `messages` (and `tools`, the template's `tools` variable) rendered with the
        model's chat template (generation prompt added); text in the messages never becomes a control token.
        `cache_namespace` (the tenant): pieces of the prompt seen before come from the tokenizer's
        `PieceCache` (the same ids; a conversation's earlier turns are not encoded again)."""
        extra = {"tools": tools} if tools else {}
        return self.check_length(self.tokenizer.encode_chat(messages, add_generation_prompt=True,
                                                            cache_namespace=cache_namespace, **extra))

    def raw_prompt_ids(self, prompt: str, cache_namespace: str | None = None) -> list[int]:
        """Token ids of a prompt the client templated itself (`raw`): its control tokens are kept."""
        return self.check_length(self.tokenizer.encode(prompt, cache_namespace=cache_namespace))

    async def chat_prompt_ids_async(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                                    cache_namespace: str | None = None) -> list[int]:
        """`chat_prompt_ids`, in a thread when the messages are large (off the event loop)."""
        if sum(len(m["content"] or "") for m in messages) + (len(json.dumps(tools)) if tools else 0) < OFFLOAD_CHARS:
            return self.chat_prompt_ids(messages, tools, cache_namespace)
        return await asyncio.to_thread(self.chat_prompt_ids, messages, tools, cache_namespace)

    async def raw_prompt_ids_async(self, prompt: str, cache_namespace: str | None = None) -> list[int]:
        """`raw_prompt_ids`, in a thread when the prompt is large (off the event loop)."""
        if len(prompt) < OFFLOAD_CHARS:
            return self.raw_prompt_ids(prompt, cache_namespace)
        return await asyncio.to_thread(self.raw_prompt_ids, prompt, cache_namespace)

    def check_length(self, ids: list[int]) -> list[int]:
        """`ids`, or PromptTooLong when no token could follow them in the context."""
        if len(ids) >= self.max_model_len:
            raise PromptTooLong(f"prompt is {len(ids)} tokens; {self.name} takes at most "
                                f"{self.max_model_len - 1} prompt tokens", prompt_tokens=len(ids),
                                max_model_len=self.max_model_len)
        return ids


class ModelCatalog:
    def __init__(self, routes: Iterable[ModelRoute]) -> None:
        self.models = [ServedModel(r) for r in routes]
        self._by_name = {n: m for m in self.models for n in m.names}

    def resolve(self, name: str) -> ServedModel:
        """The model a client means by `name`, or ModelNotFound (5007) listing what is served."""
        model = self._by_name.get(name)
        if model is None:
            raise ModelNotFound(f"no such model {name!r}; served: {sorted(self._by_name)}", model=name)
        return model
