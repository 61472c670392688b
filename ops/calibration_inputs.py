"""What layer-by-layer calibration reads: its text, the input's dense weights, and the layer order.

Calibration text (`calibration_ids`): Brown corpus genres A-H (press, religion, skills and
hobbies, popular lore, belles-lettres, government documents) by default; `edgeserve bench
weights` evaluates on genres J-R (learned writing, fiction, humour), so the two never share
a document. Or any UTF-8 text file. The first N tokens are cut into sequences of L = min(2048, N, the model's
context) tokens each (the last partial sequence is dropped).

`DenseWeights` reads a linear's float weight from the input as the quantiser streams it (dense,
FP8 dequantised block by block, or one expert of a fused experts tensor), and `in_layer_order`
orders the written tensors layer by layer, the order `ops/calibration.py` walks the model in.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from backend.config import ModelConfig
from backend.errors import WeightsError
from backend.weights import CheckpointReader

if TYPE_CHECKING:
    from ops.quantize_steps import QuantizePlan

__all__ = ["CALIB_GENRES", "EVAL_GENRES", "DEFAULT_CALIB_TOKENS", "DEFAULT_SEQ_LEN", "calibration_ids",
           "DenseWeights", "layer_of", "in_layer_order"]

CALIB_GENRES = "abcdefgh"  # Brown genres for calibration
EVAL_GENRES = "jklmnpr"  # Brown genres for evaluation (bench weights); disjoint from CALIB_GENRES
# Twice the 8,192 of GPTQ's usual recipe: the end-to-end scale tuning that follows GPTQ fit 8,192 tokens of Brown A-H
# (calibration KL 0.035 against 0.083 held out on SmolLM2 g128); 16,384 brought the held-out KL to 0.069 (BENCHMARKS.md)
DEFAULT_CALIB_TOKENS = 16384
DEFAULT_SEQ_LEN = 2048
_Step = tuple[str, Any]  # (input tensor or linear module, its output specs): a quantize plan step


def calibration_ids(model_dir: Path, cfg: ModelConfig, num_tokens: int, text_file: Path | None = None,
                    seq_len: int = DEFAULT_SEQ_LEN) -> torch.Tensor:
    """Calibration token ids [S, L] (int64) from `text_file` or Brown genres A-H, with the model's
    tokenizer. Raises `WeightsError` when the text is too short or the model has no tokenizer."""
    from backend.tokenizer import Tokenizer

    if num_tokens < 1:
        raise WeightsError(f"--calib-tokens must be positive, got {num_tokens}")
    if not (Path(model_dir) / "tokenizer.json").is_file():
        raise WeightsError(f"GPTQ calibrates on text, but {model_dir} has no tokenizer.json; use --method rtn",
                           file=str(model_dir))
    tok = Tokenizer.from_model_dir(model_dir)
    if text_file is not None:
        try:
            text = Path(text_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise WeightsError(f"cannot read calibration file {text_file}: {exc}", file=str(text_file)) from exc
        ids, source = tok.encode(text), str(text_file)
    else:
        from ops.brown_corpus import corpus_tokens, fetch_brown

        ids, _ = corpus_tokens(tok.encode, num_tokens, fetch_brown(), CALIB_GENRES)
        source = f"Brown genres {CALIB_GENRES.upper()}"
    if len(ids) < num_tokens:
        raise WeightsError(f"the calibration text ({source}) gives {len(ids)} tokens, fewer than the "
                           f"--calib-tokens {num_tokens} asked for", file=str(text_file or ""))
    if max(ids[:num_tokens]) >= cfg.vocab_size:
        raise WeightsError(f"the tokenizer in {model_dir} gives id {max(ids)}, beyond the model's vocab_size "
                           f"{cfg.vocab_size}")
    length = min(seq_len, num_tokens, cfg.max_position_embeddings)
    count = num_tokens // length
    return torch.tensor(ids[:count * length], dtype=torch.int64).view(count, length)  # [S, L]


class DenseWeights:
    """A linear module's float weight [N, K] as the input stores it: dense, FP8 dequantised with its
    block scales, or a slice of a fused experts tensor (read once for the run of its experts)."""

    def __init__(self, reader: CheckpointReader, plan: QuantizePlan) -> None:
        """`plan` is `ops.quantize.plan_quantize`'s: where fused experts live, the input format."""
        self.reader, self.plan = reader, plan
        self._fused_name, self._fused = "", torch.empty(0)

    def __call__(self, module: str) -> torch.Tensor:
        plan = self.plan
        if module in plan.slices:
            piece = plan.slices[module]
            if piece.tensor != self._fused_name:
                self._fused_name, self._fused = piece.tensor, self.reader.get(piece.tensor)  # [E, rows, K]
            return self._fused[piece.expert, piece.start:piece.stop].contiguous()  # [rows, K]
        if plan.source is None:
            return self.reader.get(f"{module}.weight")
        return plan.source.dequantize(plan.source.read(self.reader.get, module))


def layer_of(name: str) -> int:
    """The decoder layer a tensor or module belongs to (-1: none)."""
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() else -1


def in_layer_order(steps: list[_Step], num_layers: int) -> list[_Step]:
    """`steps` regrouped layer by layer (a stable sort): tensors of no layer first, then layer 0, 1, ...,
    then the multi-token-prediction layers. Checkpoint order sorts `layers.10` before `layers.2`;
    calibration walks the layers in order, so the writer does too."""
    def key(step: _Step) -> int:
        layer = layer_of(step[0])
        return layer if layer < num_layers else num_layers + layer
    return sorted(steps, key=key)
