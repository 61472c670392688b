"""Prefill -> decode KV transfer on the Mooncake Transfer Engine: pages written straight into pages.

Decode side (`MooncakeKVTransport`, `edgeserve serve --role decode --kv-transport mooncake`):
the worker starts one Transfer Engine and registers its whole page pool with it once
(`kv_regions.pool_tensors`: K/V values and FP8 scales, or latent and indexer rows).
Per request the coordinator reserves every page first, then sends the prefill request
over the existing HTTP channel with a `KVTarget`: this engine's peer name, the pool's
layout (`kv_regions.KVLayout`) and the reserved page ids.

Prefill side (`DirectKVWriter`, used by `prefill_server.py` whenever a request carries
a target): after the prompt is computed, its layers' pages are written with batched
writes of byte runs (`kv_regions.layers_runs`: page-granular, merged where pages are
consecutive on both sides) from this worker's registered pool into the target pages,
in the pool format as stored (FP8 values and their scales, latent rows), with no
staging copy. One write carries as many whole layers as fit in `WRITE_BATCH_BYTES`
(64 MiB; at least one layer): every layer of a short prompt, a bounded slice of a long
one on a large model, so that no single write outlasts the deadline checks below by
much. Then a payload-less KVLayer frame per layer says it landed, and the decode
worker checks its pages while the next batch is written. Layer by layer, every layer
cost a thread hop, a write's own round trip and a frame with a wake-up on both sides:
SmolLM2's 30 layers took ~37 ms on a 2-core VM whatever the prompt's length, and 15 ms
at 1,024 tokens in one write (`BENCHMARKS.md`, `bench pd`). The held pages'
tags are checked before and after each write (a page that changed hands would have sent
another request's KV: the transfer ends with a KVError, the decode worker discards the
reservation). A pool the target cannot take byte for byte (another format or
geometry, a tensor-parallel pool whose heads live on several ranks, on either side)
falls back to frames with the pages inside (`kv_transfer.py`).

Integrity on the decode side: after each layer lands, the reserved pages' tags are
checked (`LLMEngine.check_transfer_target(written=True)`). A page that changed hands
during the transfer (integrity fault (c)) aborts the request with KVIntegrityError
(cause "transfer_target"); unlike the HTTP transport the bytes have already landed,
so the page is also marked overwritten and its new owner is ended at its next step
(cause "overwritten") instead of reading foreign KV.

Failure and timeout: a push transport cannot recall a write in flight, so a
reservation whose direct transfer failed is not released at once: the prefill worker
starts no write later than the target's `deadline_s` after receiving the
request, and the decode worker keeps the pages until that deadline plus a grace
period (`DecodeCoordinator.direct_grace_s`) has passed, then releases them, leaving
both pools as full as before. A direct transfer is not retried on another prefill
worker with the same pages (the first one might still write); the request ends with
its typed error. The residual risk is a prefill process stalled inside one write for
longer than the grace period (a write carries at most 64 MiB: well under the default
5 s over TCP).

CUDA: the CUDA build of Mooncake registers GPU memory the same way (the pool tensors
are registered by address); the prefill side synchronises the device before its first
write so the pages hold the finished prefill.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import torch

from backend.errors import BackendUnavailable
from backend.kv_regions import KVLayout, incompatibility, layer_bytes, layers_runs, pool_layout, pool_tensors
from backend.kv_transfer import Frame, HttpKVTransport, KVTarget, PrefillRequest
from backend.mooncake_runtime import TransferEngineHandle, transfer_engine
from backend.sequence import Sequence

__all__ = ["MooncakeKVTransport", "DirectKVWriter", "WRITE_BATCH_BYTES"]

WRITE_BATCH_BYTES = 64 << 20  # bytes one batched write carries at most, unless a single layer is more


def _register_pool(te: TransferEngineHandle, cache: object) -> KVLayout:
    for t in pool_tensors(cache):
        te.register(t.data_ptr(), t.numel() * t.element_size())
    return pool_layout(cache)


class MooncakeKVTransport:
    """Decode side: the prefill worker writes into this worker's reserved pages (module docstring).
    The HTTP channel (`HttpKVTransport`) carries the request and the per-layer notices."""

    direct = True

    def __init__(self, engine: object, timeout_s: float = 60.0, token: str | None = None,
                 host: str = "127.0.0.1") -> None:
        self._http = HttpKVTransport(timeout_s, token)
        self._te = transfer_engine(host)
        self.layout = _register_pool(self._te, engine.cache)
        self.session_id = self._te.session_id
        # a tensor-parallel decode group keeps each rank's KV heads in that rank's pool: frames instead
        self._direct = getattr(engine, "kv_exchange", None) is None

    async def aclose(self) -> None:
        await self._http.aclose()

    def target(self, seq: Sequence, deadline_s: float) -> KVTarget | None:
        if not self._direct:
            return None
        return KVTarget(self.session_id, self.layout, list(seq.page_ids), deadline_s)

    def fetch(self, prefill_url: str, request: PrefillRequest) -> AsyncIterator[tuple[Frame, bytes]]:
        return self._http.fetch(prefill_url, request)


class DirectKVWriter:
    """Prefill side: writes a held request's pages into a `KVTarget` (started on first use)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self._te: TransferEngineHandle | None = None
        self._layout: KVLayout | None = None

    def refusal(self, engine: object, target: KVTarget) -> str | None:
        """Why this worker cannot write into `target` byte for byte (then: frames), or None."""
        if getattr(engine, "kv_exchange", None) is not None:
            return "tensor-parallel pool (KV heads on several ranks)"
        try:
            layout = self._start(engine)
        except BackendUnavailable as exc:
            return str(exc)
        return incompatibility(layout, target.layout)

    def _start(self, engine: object) -> KVLayout:
        if self._te is None:
            self._te = transfer_engine(self.host)
            self._layout = _register_pool(self._te, engine.cache)
        return self._layout

    def write_layers(self, engine: object, seq: Sequence, first: int, target: KVTarget, deadline: float
                     ) -> list[int]:
        """Write layers `first`, `first + 1`, ... of held `seq` into the target's pages in one batched write,
        as many whole layers as fit in `WRITE_BATCH_BYTES` (at least one); the bytes written per layer. Any
        thread. Raises KVIntegrityError when the held pages changed hands around the write, and
        BackendUnavailable when the deadline (time.monotonic) has passed or the write failed."""
        if time.monotonic() > deadline:
            raise BackendUnavailable(f"direct KV transfer of {seq.request_id} passed its deadline before layer "
                                     f"{first}; not written")
        pages, tags = seq.page_ids, seq.page_tags
        engine.check_held_pages(seq, pages, tags)
        if first == 0 and engine.cache.pages.is_cuda:
            torch.cuda.synchronize(engine.cache.pages.device)
        size = layer_bytes(self._layout, seq.num_prompt_tokens)
        count = max(1, min(self._layout.num_layers - first, WRITE_BATCH_BYTES // max(1, size)))
        src, dst, lengths = layers_runs(self._layout, pages, target.layout, target.page_ids,
                                        range(first, first + count), seq.num_prompt_tokens)
        self._te.write(target.session_id, src, dst, lengths)
        engine.check_held_pages(seq, pages, tags)
        return [size] * count
