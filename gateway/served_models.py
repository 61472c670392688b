"""Models the gateway serves: names and aliases, tokenizer, chat template, context length.

The gateway owns the text side of a request: it renders the chat template,
tokenises, checks the context length, and detokenises what comes back, so
workers only ever see token ids.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from backend.errors import ModelLoadError, ModelNotFound, PromptTooLong
from backend.tokenizer import Tokenizer
from gateway.config import ModelRoute

__all__ = ["ServedModel", "ModelCatalog"]


class ServedModel:
    """One model: `name` is what workers call it; `names` everything a client may say."""

    def __init__(self, route: ModelRoute) -> None:
        self.route = route
        self.name = route.name
        self.names = [route.name, *route.aliases]
        self.tokenizer = Tokenizer.from_model_dir(route.model_dir)
        config_path = Path(route.model_dir) / "config.json"
        try:
            config = json.loads(config_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelLoadError(f"cannot read {config_path}: {exc}") from exc
        self.max_model_len = int(route.max_model_len or config.get("max_position_embeddings", 2048))

    def chat_prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of `messages` rendered with the model's chat template (generation prompt added)."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.check_length(self.tokenizer.encode(text))

    def raw_prompt_ids(self, prompt: str) -> list[int]:
        return self.check_length(self.tokenizer.encode(prompt))

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
