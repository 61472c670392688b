"""Reading safetensors checkpoints (single file or sharded with an index).

Every failure names the file: a missing shard, a truncated or corrupt file, a
missing tensor. Tensors are loaded lazily one at a time (`safe_open`), so peak
memory is the converted model plus one tensor.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from backend.errors import WeightsError

__all__ = ["CheckpointReader"]


class CheckpointReader:
    """Maps tensor names to the safetensors file holding them."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = Path(model_dir)
        index = self.model_dir / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise WeightsError(f"corrupt safetensors index {index}: {exc}", file=str(index)) from exc
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.model_dir.glob("*.safetensors"))
            if not files:
                raise WeightsError(f"no *.safetensors file in {self.model_dir}", file=str(self.model_dir))
            weight_map = {}
        self._handles: dict[str, object] = {}
        for name in files:
            path = self.model_dir / name
            if not path.exists():
                raise WeightsError(f"missing safetensors file {path}", file=str(path))
            try:
                handle = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError, ValueError) as exc:
                raise WeightsError(f"corrupt safetensors file {path}: {exc}", file=str(path)) from exc
            self._handles[name] = handle
            if not index.exists():
                for key in handle.keys():
                    weight_map[key] = name
        self.weight_map = weight_map

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def names(self) -> Iterator[str]:
        return iter(self.weight_map)

    def get(self, name: str) -> torch.Tensor:
        """Load one tensor; a missing or unreadable tensor names its file."""
        file = self.weight_map.get(name)
        if file is None:
            raise WeightsError(f"tensor {name!r} not found in the checkpoint at {self.model_dir}", tensor=name,
                               file=str(self.model_dir))
        try:
            return self._handles[file].get_tensor(name)  # type: ignore[attr-defined]
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            path = self.model_dir / file
            raise WeightsError(f"corrupt tensor {name!r} in {path}: {exc}", tensor=name, file=str(path)) from exc
