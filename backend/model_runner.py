"""Turns a scheduled batch into model inputs (flat tokens + `StepMetadata`) and runs it: eagerly, or a pure
decode step from the decode graphs' buffers when the engine set them up (`backend/decode_graphs.py`)."""

from __future__ import annotations

import torch

from backend.attention import PrefillChunk, StepMetadata
from backend.decode_graphs import DecodeGraphs
from backend.kv_cache import PagedKVCache
from backend.model import DecoderModel
from backend.scheduler import ScheduledBatch

__all__ = ["ModelRunner"]


class ModelRunner:
    def __init__(self, model: DecoderModel, cache: PagedKVCache) -> None:
        self.model = model
        self.cache = cache
        self.page_size = cache.page_size
        self.device = model.embed.device
        # every linear of every phase runs the C GEMV at a few rows (bfloat16 on AVX512-BF16): the engine
        # then hands such steps' threads to the C kernels (kernels/cpu_threads.py)
        linears = [lin for layers in model.phase_layers.values() for layer in layers for lin in layer.linears()]
        every = [*linears, model.lm_head]
        self.gemv_decode = all(getattr(lin, "gemv", False) for lin in every)
        # steps of up to this many rows run every linear on its C GEMV (0: not every linear has one)
        self.gemv_rows = min(lin.gemv_rows for lin in every) if self.gemv_decode else 0
        self.gemv_dtype = model.lm_head.weight.dtype if self.gemv_decode else None
        self.graphs: DecodeGraphs | None = None  # set by the engine with `EngineConfig.cuda_graphs`

    def _slot(self, page_ids: list[int], position: int) -> int:
        return page_ids[position // self.page_size] * self.page_size + position % self.page_size

    def slots(self, page_ids: list[int], start: int, end: int) -> torch.Tensor:
        """Cache slots [end - start] (int64) of positions start..end-1 under a page table."""
        pos = torch.arange(start, end)
        table = torch.tensor(page_ids, dtype=torch.int64)
        return (table[pos // self.page_size] * self.page_size + pos % self.page_size).to(self.device)

    def prepare(self, batch: ScheduledBatch, device: torch.device | None = None) -> tuple[torch.Tensor, StepMetadata]:
        """Flat input ids [T] and metadata on `device` (the model's by default): decode rows first, then prefill
        chunks."""
        ps = self.page_size
        dev = self.device if device is None else device
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        for s in batch.decode:
            pos = s.num_tokens - 1  # the last sampled token is fed now
            logits_rows.append(len(tokens))
            tokens.append(s.token_at(pos))
            positions.append(pos)
            slots.append(self._slot(s.page_ids, pos))
        decode_table = decode_lens = None
        if batch.decode:
            ctx = [s.num_tokens for s in batch.decode]
            num_pages = -(-max(ctx) // ps)
            table = [s.page_ids[:num_pages] + [0] * (num_pages - len(s.page_ids[:num_pages])) for s in batch.decode]
            decode_table = torch.tensor(table, dtype=torch.int64, device=dev)  # [D, P]
            decode_lens = torch.tensor(ctx, dtype=torch.int32, device=dev)  # [D]
        chunks: list[PrefillChunk] = []
        scored_rows: list[int] = []  # prompt positions scored for prompt logprobs, after the sampled rows
        for s, n in batch.prefill:
            start = s.num_computed_tokens
            end = start + n
            chunks.append(PrefillChunk(token_start=len(tokens), num_tokens=n, context_len=end,
                                       page_table=torch.tensor([s.page_ids[: -(-end // ps)]], dtype=torch.int64,
                                                               device=dev)))
            scored_rows.extend(len(tokens) + p - start for p in s.scored_positions(start, n))
            tokens.extend(s.prompt_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(self._slot(s.page_ids, p) for p in range(start, end))
            if end == s.num_prompt_tokens:
                logits_rows.append(len(tokens) - 1)
        meta = StepMetadata(
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            slots=torch.tensor(slots, dtype=torch.int64, device=dev),
            num_decode=len(batch.decode),
            decode_page_table=decode_table,
            decode_context_lens=decode_lens,
            prefills=chunks,
            logits_rows=torch.tensor(logits_rows + scored_rows, dtype=torch.int64, device=dev),
            page_size=ps,
            mask_dtype=self.model.dtype,
        )
        return torch.tensor(tokens, dtype=torch.int64, device=dev), meta

    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        """Logits [R, vocab] in the LM head's dtype (`sample` and `logprobs_of` widen what they need):
        decode sequences, then prompts completed this step, then the scored positions of prompts that
        ask for prompt logprobs (chunk by chunk, in batch order). From the decode graphs, the rows are the graph's
        output buffer: valid until the next step (the engine copies them to the host at once)."""
        if self.graphs is not None and self.graphs.takes(batch):
            logits = self.graphs.run(*self.prepare(batch, torch.device("cpu")))
            if logits is not None:
                return logits
        input_ids, meta = self.prepare(batch)
        return self.model.forward(input_ids, meta, self.cache, float_logits=False)
