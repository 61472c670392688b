"""Reading and writing safetensors checkpoints (single file or sharded with an index).

Every failure names the file: a missing shard, a truncated or corrupt file, a
missing tensor. Tensors are loaded lazily one at a time (`safe_open`), so peak
memory is the converted model plus one tensor; `spec` gives a tensor's dtype and
shape from the header alone. `get_slice` reads a contiguous range of one dimension
(a tensor-parallel rank's rows or columns) without reading the rest of the tensor;
`bytes_read` counts the tensor bytes a reader has returned (what a rank loaded).

A reader opened with a `prefix` serves the part of the checkpoint under it, by the
names without it: Kimi K2.5/K2.6 (`Kimi_K25ForConditionalGeneration`) store their text
model as `language_model.model.layers...` and `language_model.lm_head.weight` beside a
vision tower, so `get("model.layers.0.self_attn.kv_b_proj.weight")` reads
`language_model.model.layers.0.self_attn.kv_b_proj.weight`. Tensors outside the prefix
(`vision_tower.*`, `mm_projector.*`, ...) are never read; one info log line says how
many there are and under which top-level names.

`write_safetensors` streams a file: the header (every name, dtype, shape and offset)
is written first from the specs, then each tensor's bytes as it is produced, so a
writer holds one tensor at a time.
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from backend.errors import WeightsError
from backend.weight_formats import TensorSpec

__all__ = ["CheckpointReader", "SAFETENSORS_DTYPES", "write_safetensors"]

# safetensors header dtype names <-> torch dtypes
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E8M0": torch.float8_e8m0fnu,  # power-of-two scales (FP8 checkpoints with scale_fmt ue8m0)
}
_DTYPE_NAMES = {v: k for k, v in SAFETENSORS_DTYPES.items()}

log = logging.getLogger(__name__)


class CheckpointReader:
    """Maps tensor names to the safetensors file holding them (under `prefix`: see the module docstring)."""

    def __init__(self, model_dir: Path, prefix: str = "") -> None:
        self.model_dir = Path(model_dir)
        self.prefix = prefix
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
        self.bytes_read = 0  # tensor bytes returned by get / get_slice
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
        self.weight_map = self._under_prefix(weight_map) if prefix else weight_map  # name (prefix removed) -> file

    def _under_prefix(self, weight_map: dict[str, str]) -> dict[str, str]:
        """The entries under `self.prefix`, by their names without it; the others are logged once."""
        inside = {name[len(self.prefix):]: file for name, file in weight_map.items() if name.startswith(self.prefix)}
        if not inside:
            raise WeightsError(f"no tensor in {self.model_dir} is under {self.prefix!r}, where config.json says the "
                               f"text model's weights are", file=str(self.model_dir))
        outside = sorted({name.split(".")[0] for name in weight_map if not name.startswith(self.prefix)})
        if outside:
            log.info("skipping %d checkpoint tensors outside %r (not the text model): %s",
                     len(weight_map) - len(inside), self.prefix, ", ".join(f"{top}.*" for top in outside))
        return inside

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def names(self) -> Iterator[str]:
        return iter(self.weight_map)

    def spec(self, name: str) -> TensorSpec:
        """dtype and shape of one tensor, from the file header (no data read)."""
        file = self.weight_map.get(name)
        if file is None:
            raise WeightsError(f"tensor {self.prefix + name!r} not found in the checkpoint at {self.model_dir}",
                               tensor=self.prefix + name, file=str(self.model_dir))
        view = self._handles[file].get_slice(self.prefix + name)  # type: ignore[attr-defined]
        dtype = SAFETENSORS_DTYPES.get(view.get_dtype())
        if dtype is None:
            raise WeightsError(f"tensor {name!r} in {self.model_dir / file} has unsupported dtype {view.get_dtype()}",
                               tensor=name, file=str(self.model_dir / file))
        return TensorSpec(dtype, tuple(view.get_shape()))

    def get(self, name: str) -> torch.Tensor:
        """Load one tensor; a missing or unreadable tensor names its file."""
        return self._read(name, lambda handle, key: handle.get_tensor(key))

    def get_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of dimension `dim` of one tensor, read from the file without the rest
        (safetensors slices); a range outside the stored shape is a WeightsError."""
        shape = self.spec(name).shape
        if not 0 <= dim < len(shape):
            raise WeightsError(f"tensor {self.prefix + name!r} of shape {list(shape)} has no dim {dim}",
                               tensor=self.prefix + name, file=str(self.model_dir))
        return self.get_region(name, [(0, n) for n in shape[:dim]] + [(start, stop)])

    def get_region(self, name: str, ranges: list[tuple[int, int]]) -> torch.Tensor:
        """The block [start, stop) per leading dimension (`ranges`, one per dim from the first; the
        dims after them whole) of one tensor, read without the rest of it."""
        shape = self.spec(name).shape
        if len(ranges) > len(shape) or any(not 0 <= a <= b <= n for (a, b), n in zip(ranges, shape)):
            raise WeightsError(f"region {ranges} is outside tensor {self.prefix + name!r} of shape {list(shape)}",
                               tensor=self.prefix + name, file=str(self.model_dir))
        index = tuple(slice(a, b) for a, b in ranges)
        return self._read(name, lambda handle, key: handle.get_slice(key)[index])

    def _read(self, name: str, fetch: Callable[[Any, str], torch.Tensor]) -> torch.Tensor:
        """`fetch(file handle, stored name)` for tensor `name`, counted in `bytes_read`; a missing
        tensor or a read that fails is a WeightsError naming the tensor and its file."""
        file = self.weight_map.get(name)
        if file is None:
            raise WeightsError(f"tensor {self.prefix + name!r} not found in the checkpoint at {self.model_dir}",
                               tensor=self.prefix + name, file=str(self.model_dir))
        try:
            tensor = fetch(self._handles[file], self.prefix + name)
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            path = self.model_dir / file
            raise WeightsError(f"corrupt tensor {self.prefix + name!r} in {path}: {exc}", tensor=self.prefix + name,
                               file=str(path)) from exc
        self.bytes_read += tensor.nbytes
        return tensor


def write_safetensors(path: Path, specs: dict[str, TensorSpec], tensors: Iterable[tuple[str, torch.Tensor]],
                      metadata: dict[str, str] | None = None) -> int:
    """Stream a safetensors file: the header from `specs` (in their order), then each tensor
    of `tensors`, which must come in the same order and match its spec. Returns bytes written."""
    header: dict[str, object] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for name, spec in specs.items():
        header[name] = {"dtype": _DTYPE_NAMES[spec.dtype], "shape": list(spec.shape),
                        "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # data starts 8-byte aligned
    order = iter(specs.items())
    with Path(path).open("wb") as out:
        out.write(struct.pack("<Q", len(header_bytes)))
        out.write(header_bytes)
        for name, tensor in tensors:
            want_name, spec = next(order, (None, None))
            if name != want_name or spec is None or TensorSpec(tensor.dtype, tuple(tensor.shape)) != spec:
                raise WeightsError(f"{path}: tensor {name!r} {tensor.dtype} {tuple(tensor.shape)} does not match "
                                   f"the planned header entry {want_name!r} {spec}", tensor=name, file=str(path))
            out.write(memoryview(tensor.contiguous().view(torch.uint8).reshape(-1).numpy()))
        missing = next(order, None)
        if missing is not None:
            raise WeightsError(f"{path}: tensor {missing[0]!r} planned in the header was never written",
                               tensor=missing[0], file=str(path))
    return 8 + len(header_bytes) + offset
