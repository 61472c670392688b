"""CUDA graphs for pure decode steps: one graph launch a step instead of hundreds of kernel launches.

A decode step of a small model on a GPU is bound by launching kernels from Python, not by the kernels: on
an H200, SmolLM2-135M's c = 1 bfloat16 step launched 681 kernels and kept the GPU busy 1.38 ms of its 21 ms
(`ops/gpu_engine_check.py`'s profile). A pure decode step's shapes depend only on its number of rows and
its page-table width, so a graph captured once per batch size replays every later step of that size with
the step's inputs copied into the graph's own buffers:

- **Buckets.** Sizes 1, 2, 4, 8, then multiples of 8 up to `max_rows`; a step of d rows runs the smallest
  bucket >= d. Rows d.. are padding: token 0 at position 0, its K/V written to the pad page (a page the
  engine holds for this alone, so no sequence's pages are touched), attending to that one key.
- **Page tables** are always `max_pages` wide (the engine's longest context in pages), the real rows'
  pages first and page 0 after them; the attention kernel reads only each row's `context_lens[b]` keys,
  so the width costs no reads.
- **Inputs** are built on the host (`ModelRunner.prepare` on the CPU) and copied into the buffers, one
  copy each; the logits are the graph's output buffer, rows d.. dropped. They stay valid until the next
  step, which is when the engine has copied them to the host.

Which steps: decode rows only (no prompt chunk: its shapes vary with the chunk), one process (tensor
parallelism sends each step over a channel), dense attention models (what `ops/gpu_engine_check.py`'s parity
compares; MoE and MLA layers run eagerly). Numerics: the same kernels on the same rows; only the GEMMs' row
count changes with padding, so results equal the eager step's to GEMM rounding (bit for bit where the GEMM's
row results do not depend on the row count). A capture that raises is logged, and every later step of the
engine runs eagerly.

Measured on an H200 (`ops/gpu_engine_check.py`, SmolLM2-135M's shapes, random weights): the c = 1 bf16 step
33.4 -> 4.0 ms (1.45 ms of it GPU-busy), decode tok/s 7.6x at c = 1 and 2.9x at c = 32 in bf16, 5.8x and
1.7x with FP8 KV and INT4 decode weights; float32 greedy tokens equal to the eager steps' and the CPU's. Hence
`EngineConfig.cuda_graphs` defaults to on with a CUDA device.

`capture=False` (the CPU, where there are no graphs) runs the same padded steps from the same buffers
eagerly: that is how the CPU tests check the padding, the buffers and the pad page.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from backend.attention import StepMetadata
from backend.kv_cache import PagedKVCache

if TYPE_CHECKING:
    from backend.model import DecoderModel
    from backend.scheduler import ScheduledBatch

__all__ = ["DecodeGraphs", "buckets", "graphs_supported"]

log = logging.getLogger(__name__)


def buckets(max_rows: int) -> list[int]:
    """Batch sizes a graph is captured for: 1, 2, 4, 8, then every multiple of 8, up to `max_rows` (included)."""
    sizes = [s for s in (1, 2, 4) if s < max_rows] + list(range(8, max_rows + 8, 8))
    return [s for s in sizes if s < max_rows] + [max_rows]


def graphs_supported(model: DecoderModel) -> str | None:
    """None when decode steps of `model` may replay graphs, else why not."""
    if model.group is not None:
        return "tensor parallelism sends each step to the other ranks"
    for layers in model.phase_layers.values():
        if any(layer.moe is not None or layer.mla is not None for layer in layers):
            return "MoE and MLA layers run eagerly"
    return None


class DecodeGraphs:
    """Static buffers for decode steps of up to `max_rows` rows and, with `capture`, one CUDA graph per bucket
    (captured on the bucket's first step). `pad_page`: a page of `cache` nobody else is given."""

    def __init__(self, model: DecoderModel, cache: PagedKVCache, pad_page: int, max_rows: int, max_pages: int,
                 capture: bool) -> None:
        self.model, self.cache = model, cache
        self.capture = capture
        self.sizes = buckets(max_rows)
        self.max_pages = max_pages
        dev = model.embed.device
        n = self.sizes[-1]
        self.pad_slot = pad_page * cache.page_size
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slots = torch.full((n,), self.pad_slot, dtype=torch.int64, device=dev)
        self.page_table = torch.zeros(n, max_pages, dtype=torch.int64, device=dev)
        self.page_table[:, 0] = pad_page
        self.context_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.logits_rows = torch.arange(n, dtype=torch.int64, device=dev)
        self.pad_page = pad_page
        self.graphs: dict[int, tuple[Any, torch.Tensor]] = {}  # bucket -> (CUDAGraph, its logits buffer)
        self.pool: Any = None  # the graphs' shared memory pool
        self.failed: str | None = None  # why capturing failed (graphs off from then on)
        self.replays = 0  # steps run from a graph (or, without capture, from the buffers)

    def bucket(self, rows: int) -> int | None:
        """The smallest bucket holding `rows` rows, or None."""
        return next((s for s in self.sizes if s >= rows), None)

    def takes(self, batch: ScheduledBatch) -> bool:
        """Whether `batch` runs here: decode rows only, no more than the largest bucket."""
        return self.failed is None and not batch.prefill and 0 < len(batch.decode) <= self.sizes[-1]

    def _meta(self, rows: int) -> StepMetadata:
        """The metadata of a `rows`-row bucket over the buffers (views: a graph reads whatever they hold)."""
        return StepMetadata(positions=self.positions[:rows], slots=self.slots[:rows], num_decode=rows,
                            decode_page_table=self.page_table[:rows], decode_context_lens=self.context_lens[:rows],
                            prefills=[], logits_rows=self.logits_rows[:rows], page_size=self.cache.page_size,
                            mask_dtype=self.model.dtype)

    def _fill(self, input_ids: torch.Tensor, meta: StepMetadata, rows: int) -> None:
        """Copy a d-row step (host tensors from `ModelRunner.prepare`) into the buffers, rows d..`rows` padded."""
        d = input_ids.shape[0]
        width = meta.decode_page_table.shape[1]
        self.input_ids[:d].copy_(input_ids)
        self.positions[:d].copy_(meta.positions)
        self.slots[:d].copy_(meta.slots)
        self.context_lens[:d].copy_(meta.decode_context_lens)
        table = torch.zeros(d, self.max_pages, dtype=torch.int64)
        table[:, :width] = meta.decode_page_table
        self.page_table[:d].copy_(table)
        if rows > d:  # padding rows: the pad page's first slot, one key
            self.input_ids[d:rows] = 0
            self.positions[d:rows] = 0
            self.slots[d:rows] = self.pad_slot
            self.context_lens[d:rows] = 1
            self.page_table[d:rows] = 0
            self.page_table[d:rows, 0] = self.pad_page

    def _capture(self, rows: int) -> None:
        """Capture the `rows`-row bucket's forward (two eager runs first, on a side stream, as CUDA asks)."""
        meta = self._meta(rows)
        ids = self.input_ids[:rows]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # Triton compiles, cuBLAS picks its kernels, the allocator warms
                self.model.forward_local(ids, meta, self.cache, float_logits=False)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.model.forward_local(ids, meta, self.cache, float_logits=False)
        self.pool = graph.pool()
        self.graphs[rows] = (graph, out)

    def run(self, input_ids: torch.Tensor, meta: StepMetadata) -> torch.Tensor | None:
        """Logits [d, vocab] (the LM head's dtype) of a d-row decode step whose inputs `ModelRunner.prepare`
        built on the host; None when it cannot run here (the caller runs the step eagerly)."""
        d = input_ids.shape[0]
        rows = self.bucket(d)
        if rows is None or self.failed is not None or meta.prefills or meta.decode_page_table.shape[1] > self.max_pages:
            return None
        self._fill(input_ids, meta, rows)
        if not self.capture:  # the same padded step, eagerly (fresh metadata: its masks are built per step)
            out = self.model.forward_local(self.input_ids[:rows], self._meta(rows), self.cache, float_logits=False)
            self.replays += 1
            return out[:d]
        if rows not in self.graphs:
            try:
                self._capture(rows)
            except Exception as exc:  # noqa: BLE001 - graphs are an optimisation: log once, run eagerly
                self.failed = f"{type(exc).__name__}: {exc}"
                log.warning("CUDA graph capture failed, decode steps run eagerly: %s", self.failed)
                torch.cuda.synchronize()
                return None
        graph, out = self.graphs[rows]
        graph.replay()
        self.model.steps_by_phase["decode"] += 1
        self.replays += 1
        return out[:d]
