"""The prefill side of disaggregation: `POST /v1/prefill` computes a prompt and streams its KV out.

The request runs in this worker's engine with `max_tokens=1` (the first token is
sampled here, with the request's own sampling parameters and seed) and
`hold=True`, so its pages outlive the finish. Then each layer's K/V is read from
the pool, quantised to the wire format (FP8 by default) and sent as one frame
(`kv_transfer.py`); an FP8 pool's pages go on an FP8 wire as stored, values and
exponents, with no dequantising and quantising again (`LLMEngine.read_kv_stored`).
The held pages are released when the last frame is out, or when the reader goes
away mid-transfer (the response is cancelled: `finally`), or at the latest after
the engine's `held_timeout_s`. Prefix caching, when on, makes
a prompt that starts with cached blocks compute only its tail.

A request with a `kv_target` (the decode worker uses `--kv-transport mooncake`) gets
its pages written straight into the decode worker's reserved pages by
`mooncake_transfer.DirectKVWriter`, several layers a write (up to 64 MiB), and frames
without payload that say what landed, one per layer, sent together after each write;
when this pool cannot be copied byte for byte into the target's, the pages go in the
frames instead (`KVBegin.direct` tells the decode worker which).

Each layer is read off the event loop while the engine thread may free the held
pages (expiry, abort) and reuse them; `LLMEngine.read_kv` checks the pages' tags
around the read, and a page that changed hands ends the transfer with a KVError
frame (KVIntegrityError), never with another request's KV (integrity fault (d)).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from backend.async_engine import AsyncEngine
from backend.closing_response import ClosingStreamingResponse
from backend.engine import LLMEngine
from backend.errors import EdgeServeError, InvalidRequest
from backend.kv_transfer import KV_MEDIA_TYPE, WIRE_FORMATS, KVBegin, KVEnd, KVError, KVLayer, PrefillRequest, \
    encode_fp8_layer, encode_frame, encode_layer
from backend.mooncake_runtime import advertised_host
from backend.mooncake_transfer import DirectKVWriter
from backend.protocol import ErrorEvent, FinishEvent, TokenEvent
from backend.sampling_params import SamplingParams
from backend.sequence import Sequence
from backend.transfer_stats import TransferStats

__all__ = ["prefill_endpoint"]

log = logging.getLogger(__name__)
_decoder = msgspec.json.Decoder(PrefillRequest)


def _first_token_params(params: SamplingParams) -> SamplingParams:
    """The request's sampling for exactly one token; stops are judged by the decode worker."""
    fields = {f: getattr(params, f) for f in params.__struct_fields__}
    return SamplingParams(**{**fields, "max_tokens": 1, "stop": [], "stop_token_ids": [], "ignore_eos": True})


def prefill_endpoint(engine: AsyncEngine, stats: TransferStats, writer: DirectKVWriter | None = None):
    """The Starlette endpoint serving `POST /v1/prefill` on `engine`; `writer` serves direct transfers
    (default: on `advertised_host()`, its Transfer Engine started by the first request with a target)."""
    writer = writer or DirectKVWriter(advertised_host())

    async def prefill(request: Request) -> Response:
        received = time.monotonic()
        try:
            req = _decoder.decode(await request.body())
            if req.wire_format not in WIRE_FORMATS:
                raise InvalidRequest(f"unknown wire format {req.wire_format!r}", field="wire_format")
            events = engine.submit(req.prompt_ids, _first_token_params(req.params), req.request_id,
                                   cache_salt=req.cache_salt, hold=True)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            return JSONResponse({"error": InvalidRequest(f"invalid prefill request: {exc}").to_dict()}, 400)
        except EdgeServeError as exc:
            return JSONResponse({"error": exc.to_dict()}, status_code=exc.http_status)
        direct = None
        if req.kv_target is not None:
            refusal = writer.refusal(engine.engine, req.kv_target)
            if refusal is None:
                direct = (writer, received + req.kv_target.deadline_s)
            else:
                log.info("request %s: KV sent in frames, not written directly: %s", req.request_id, refusal)
        async def close() -> None:  # also when `_send` never started (closing_response.py)
            await events.aclose()  # aborts the prefill if it is not done
            engine.engine.release_held(req.request_id)

        return ClosingStreamingResponse(_send(engine, req, events, stats, direct), on_close=close,
                                        media_type=KV_MEDIA_TYPE)

    return prefill


async def _send(engine: AsyncEngine, req: PrefillRequest, events: AsyncIterator, stats: TransferStats,
                direct: tuple[DirectKVWriter, float] | None) -> AsyncIterator[bytes]:
    eng = engine.engine
    first: int | None = None
    cached, tokens, sent, started, layers_from = 0, 0, 0, time.perf_counter(), 0.0
    try:
        async for ev in events:
            if isinstance(ev, TokenEvent):
                first = ev.token_ids[0]
            elif isinstance(ev, FinishEvent):
                cached = ev.cached_tokens
            elif isinstance(ev, ErrorEvent):
                yield encode_frame(KVError(ev.code, ev.type, ev.message))
                return
        seq = eng.scheduler.held.get(req.request_id)
        if seq is None or first is None:
            err = EdgeServeError(f"prefill of {req.request_id} ended without its KV")
            yield encode_frame(KVError(err.code, type(err).__name__, err.message))
            return
        cfg = eng.model.cfg
        state = seq.generator.get_state().numpy().tobytes() if seq.generator is not None else None
        frame = encode_frame(KVBegin(req.request_id, first, seq.num_prompt_tokens, cfg.num_layers, cfg.num_kv_heads,
                                     cfg.head_dim, req.wire_format, cached, state, direct=direct is not None))
        sent += len(frame)
        yield frame
        layers_from, layer = time.perf_counter(), 0
        while layer < cfg.num_layers:
            try:  # reading and quantising (or writing) layers is CPU and I/O work: off the event loop
                if direct is not None:  # a batch of layers in one write, then a frame per layer in one chunk
                    written = await asyncio.to_thread(direct[0].write_layers, eng, seq, layer, req.kv_target,
                                                      direct[1])
                    sent += sum(written)
                    frame = b"".join(encode_frame(KVLayer(layer + i, 0, 0, 0, direct_bytes=n))
                                     for i, n in enumerate(written))
                    layer += len(written)
                else:
                    frame = await asyncio.to_thread(_layer_frame, eng, seq, layer, req.wire_format)
                    layer += 1
            except EdgeServeError as exc:  # the held pages changed hands, a write failed (or the engine stopped)
                yield encode_frame(KVError(exc.code, type(exc).__name__, exc.message))
                return
            sent += len(frame)
            yield frame
        yield encode_frame(KVEnd())
        tokens = seq.num_prompt_tokens
    finally:
        eng.release_held(req.request_id)
        now = time.perf_counter()
        stats.record(sent, now - started, ok=tokens > 0, tokens=tokens,
                     layer_seconds=now - layers_from if layers_from else 0.0, direct=direct is not None)


def _layer_frame(eng: LLMEngine, seq: Sequence, layer: int, wire_format: str) -> bytes:
    """One layer's KV frame, read with `read_kv`'s tag checks (runs in a worker thread). FP8 pages go on an FP8
    wire as stored, with no dequantising and quantising again."""
    stored = eng.read_kv_stored(seq, layer) if wire_format == "fp8_e4m3" else None
    if stored is not None:
        return encode_fp8_layer(layer, *stored)
    k, v = eng.read_kv(seq, layer)
    return encode_layer(layer, k, v, wire_format)
