"""The decode side of disaggregation: reserve pages, fetch the KV from a prefill worker, decode.

    submit(request)       validate now (typed refusals before any byte is sent), then stream:
      1. reserve          every page the request may need, in this worker's pool, before
                          anything is sent (a transfer never lands in a full pool); waits
                          up to `reserve_timeout_s` for pages, else CapacityError (3040)
      2. fetch            the KV from a prefill worker (round-robin), frame by frame,
                          installing each layer as it arrives; the whole transfer has a
                          `transfer_timeout_s` deadline
      3. activate         the request joins the decode batch; its first token (sampled by
                          the prefill worker) is emitted at the next step, then decoding goes on

The gateway's router names the prefill worker (`GenerateRequest.prefill_url`);
without one, this coordinator picks from its own list (round-robin). A named one is
accepted only if it is in that list or a live prefill worker registered for this
model (`check_prefill_url`, `prefill_allowlist.py`): else a typed 400 before any
connection is made, so a request cannot make this worker POST to any URL.
Faults: if the prefill worker fails or times out mid-transfer, the reservation is
kept and the fetch is retried once on the next prefill worker; no token has reached
the client yet (the first token is emitted only after activation). When no prefill
worker succeeds, the pages are released and the request ends with its typed error
(in-stream). If our reader leaves (client gone), the transfer is closed (the prefill
worker frees its side) and the reservation released.

Direct transports (`--kv-transport mooncake`, `mooncake_transfer.py`): the request
carries the reserved pages as the write target and each layer frame only says that
layer landed; its pages' tags are checked then (`check_transfer_target(written=True)`).
A failed direct transfer is not retried with the same pages (the first prefill
worker may still be writing), and its reservation is released only after the
transfer's deadline plus `direct_grace_s`, when no write can still land.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator

import httpx
import torch

from backend.async_engine import AsyncEngine
from backend.errors import BackendUnavailable, CapacityError, EdgeServeError, InvalidRequest, InvalidSamplingParams
from backend.kv_transfer import KVBegin, KVEnd, KVLayer, KVTransport, PrefillRequest, decode_layer
from backend.prefill_allowlist import PrefillAllowlist
from backend.protocol import ErrorEvent, Event, GenerateRequest
from backend.sequence import Sequence, SequenceStatus
from backend.transfer_stats import TransferStats

__all__ = ["DecodeCoordinator"]

log = logging.getLogger(__name__)


class DecodeCoordinator:
    """`registry_url` and `model`: also accept prefill workers registered in that Redis for `model`."""

    def __init__(self, engine: AsyncEngine, prefill_urls: list[str], transport: KVTransport, *,
                 wire_format: str = "fp8_e4m3", reserve_timeout_s: float = 30.0,
                 transfer_timeout_s: float = 60.0, registry_url: str | None = None,
                 model: str | None = None, direct_grace_s: float = 5.0) -> None:
        self.engine = engine
        self.prefill_urls = list(prefill_urls)
        self.allowlist = PrefillAllowlist(self.prefill_urls, registry_url, model)
        self.transport = transport
        self.wire_format = wire_format
        self.reserve_timeout_s = reserve_timeout_s
        self.transfer_timeout_s = transfer_timeout_s
        self.direct_grace_s = direct_grace_s
        self.stats = TransferStats()
        self._turn = itertools.count()

    async def check_prefill_url(self, prefill_url: str | None) -> None:
        """Refuse (InvalidRequest, 400) a routed prefill worker that is neither configured nor registered."""
        if prefill_url is not None and not await self.allowlist.allows(prefill_url):
            raise InvalidRequest("prefill_url is not a configured or registered prefill worker of this model",
                                 field="prefill_url")

    async def aclose(self) -> None:
        await self.allowlist.aclose()

    def submit(self, req: GenerateRequest) -> AsyncIterator[Event]:
        """Validate now (raises typed errors) and return the request's event stream.
        `req.prefill_url` must have passed `check_prefill_url`."""
        for field in ("logprobs", "prompt_logprobs"):  # the prefill worker samples the first token
            if getattr(req.params, field) is not None:
                raise InvalidSamplingParams(f"`{field}` is not served by a prefill/decode pair", field=field)
        if req.params.grammar is not None:  # the prefill worker would sample the first token unconstrained
            field = "tool_choice" if req.params.grammar.kind == "lark" else "response_format"
            raise InvalidSamplingParams(f"`{field}` (grammar-constrained output) is not served by a prefill/decode "
                                        "pair", field=field)
        seq = self.engine.engine.new_sequence(req.prompt_ids, req.params, req.request_id)
        return self._run(seq, req)

    async def _run(self, seq: Sequence, req: GenerateRequest) -> AsyncIterator[Event]:
        eng = self.engine.engine
        events = self.engine.attach(seq)
        activated = False
        try:
            try:
                await self._reserve(seq)
                first, state = await self._fetch_with_retry(seq, req)
            except EdgeServeError as exc:
                yield ErrorEvent(exc.code, type(exc).__name__, exc.message, 0)
                return
            eng.activate(seq, first, state)
            activated = True
            async with contextlib.aclosing(events):
                async for ev in events:
                    yield ev
        finally:
            if not activated and seq.direct_deadline is not None:  # a write may still land until then
                delay = max(0.0, seq.direct_deadline - time.monotonic()) + self.direct_grace_s
                asyncio.get_running_loop().call_later(delay, eng.release_reserved, seq)
            else:
                eng.release_reserved(seq)  # no-op once activated
            if not activated:
                self.engine.detach(seq.request_id)

    async def _reserve(self, seq: Sequence) -> None:
        deadline = time.monotonic() + self.reserve_timeout_s
        while not self.engine.engine.reserve(seq):
            if time.monotonic() > deadline:
                raise CapacityError(f"no KV pages freed up for request {seq.request_id} within "
                                    f"{self.reserve_timeout_s:.0f}s", request_id=seq.request_id)
            await asyncio.sleep(0.005)

    async def _fetch_with_retry(self, seq: Sequence, req: GenerateRequest) -> tuple[int, torch.Tensor | None]:
        start = next(self._turn)
        urls = [self.prefill_urls[(start + i) % len(self.prefill_urls)] for i in range(len(self.prefill_urls))]
        if req.prefill_url:  # the router's pairing first, our own list as the fallback
            urls = [req.prefill_url, *(u for u in urls if u != req.prefill_url)]
        urls = urls[:2]
        if not urls:
            raise BackendUnavailable(f"no prefill worker for request {seq.request_id}: none configured, none routed")
        for attempt, url in enumerate(urls):
            try:
                async with asyncio.timeout(self.transfer_timeout_s):
                    return await self._fetch(url, seq, req, attempt)
            except (BackendUnavailable, TimeoutError) as exc:
                if isinstance(exc.__cause__, httpx.ConnectError):  # never reached it: nothing was written
                    seq.direct_deadline = None
                # another prefill worker cannot help when our own engine is the one that stopped, nor
                # after a direct transfer began (its writes may still land in these pages)
                if attempt == len(urls) - 1 or not self.engine.alive or seq.direct_deadline is not None:
                    if isinstance(exc, TimeoutError):
                        raise BackendUnavailable(f"KV transfer from {url} timed out after "
                                                 f"{self.transfer_timeout_s:.0f}s") from exc
                    raise
                log.warning("KV transfer for %s from %s failed (%s); retrying on %s", seq.request_id, url, exc,
                            urls[attempt + 1])
        raise AssertionError("unreachable")

    async def _fetch(self, url: str, seq: Sequence, req: GenerateRequest, attempt: int
                     ) -> tuple[int, torch.Tensor | None]:
        eng = self.engine.engine
        cfg = eng.model.cfg
        target = self.transport.target(seq, self.transfer_timeout_s)
        preq = PrefillRequest(req.prompt_ids, req.params, f"{seq.request_id}.{attempt}", req.cache_salt,
                              self.wire_format, target)
        if target is not None:  # from now on the prefill worker may write into seq's pages
            seq.direct_deadline = time.monotonic() + target.deadline_s
        begin: KVBegin | None = None
        layers, received, started = set(), 0, time.perf_counter()
        begun = started
        frames = self.transport.fetch(url, preq)
        try:
            async with contextlib.aclosing(frames):
                async for header, payload in frames:
                    received += len(payload) + 64  # payload plus a header's worth
                    if isinstance(header, KVBegin):
                        begun = time.perf_counter()
                        if (header.num_layers, header.num_kv_heads, header.head_dim, header.num_tokens) != \
                                (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, seq.num_prompt_tokens):
                            raise BackendUnavailable(f"prefill worker {url} sent KV of another shape: {header}")
                        begin = header
                    elif isinstance(header, KVLayer) and begin is not None:
                        if begin.direct:  # written into seq's pages already: check they are still seq's
                            received += header.direct_bytes
                            eng.check_transfer_target(seq, written=True)
                        else:
                            eng.install_kv(seq, header.layer, *decode_layer(header, payload, begin))
                        layers.add(header.layer)
                    elif isinstance(header, KVEnd):
                        if begin is None or len(layers) != cfg.num_layers:
                            raise BackendUnavailable(f"prefill worker {url} ended the transfer early")
                        seq.num_cached_tokens = begin.cached_tokens
                        state = (torch.frombuffer(bytearray(begin.generator_state), dtype=torch.uint8)
                                 if begin.generator_state is not None else None)
                        now = time.perf_counter()
                        self.stats.record(received, now - started, True, seq.num_prompt_tokens, now - begun,
                                          begin.direct)
                        return begin.first_token, state
            raise BackendUnavailable(f"prefill worker {url} closed the transfer before its end")
        except BaseException:
            if seq.status is SequenceStatus.RECEIVING:
                self.stats.record(received, time.perf_counter() - started, False)
            raise
