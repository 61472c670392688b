"""KV transfer from a prefill worker to a decode worker: wire frames and the transport contract.

One transfer is one stream of length-prefixed frames, prefill -> decode:

    frame  = u32 big-endian header length | msgpack header (msgspec struct) | payload (header.payload_bytes)

    KVBegin   first token, prompt length, geometry, wire format, sampler state, cached tokens
    KVLayer   one layer: payload = K | V | K exponents | V exponents   (one frame per layer)
    KVEnd     every layer sent
    KVError   the prefill failed (typed error code); nothing more follows

Pages travel as raw bytes with their dtype and shape, never as JSON numbers, in
token order [num_tokens, num_kv_heads, head_dim] (K in the interleaved RoPE layout
both sides use): page sizes of the two pools need not match. Wire formats:

- ``fp8_e4m3``: e4m3 values plus one int8 power-of-two exponent per (token, KV
  head), the FP8 pool format of `kernels/kv_store.py`, quantised by the prefill
  worker on the way out. A decode worker with an FP8 pool copies the bytes as is.
  head_dim + 1 bytes per (token, head) against BF16's 2 * head_dim: 65 vs 128 B.
- ``bf16``: values only (for comparison, and for decode pools that are not FP8).

MLA models (a `LatentKVCache`) send one latent row per token instead of K and V
(`LatentRows`): a KVLayer frame's payload is then the rows' raw bytes in a latent row
format (`kernels/latent_kv_store.py`, named in `latent_format`), followed by the DSA
indexer's key rows when the model has an indexer. The rows travel in the sender's pool
format when that pool is FP8 (never re-quantised) or already the wire format; a wider
pool's rows are converted to the wire format on the way out (FP8: 656 B per token per
layer for Kimi against BF16's 1,152 B). A receiving pool of the same format copies the
bytes as they are; any other dequantises and re-stores them in its own format.

Sending one frame per layer lets the decode worker install layer i while layer
i + 1 is being read and sent. `KVTransport` is the seam between the two transports:
`HttpKVTransport` (the pages travel in the frames of a streamed HTTP response) and
`MooncakeKVTransport` (`mooncake_transfer.py`): there the request carries a
`KVTarget` (the decode worker's Transfer Engine, its pool layout, the reserved page
ids), the prefill worker writes its pages straight into those pages, and the frames
only say what landed: `KVBegin.direct` set, one payload-less KVLayer per layer with
`direct_bytes`. A prefill worker that cannot write directly (another pool format, a
tensor-parallel pool, no Mooncake library) ignores the target and sends the pages in
the frames as above, which the decode worker installs as usual.
"""

from __future__ import annotations

import struct
from collections.abc import AsyncIterator
from typing import Protocol

import httpx
import msgspec
import torch

from backend.errors import BackendUnavailable, EdgeServeError, InvalidRequest, error_from_code
from backend.kv_regions import KVLayout
from backend.latent_kv_cache import LatentRows
from backend.sampling_params import SamplingParams
from backend.sequence import Sequence
from backend.worker_auth import auth_headers
from kernels.kv_store import quantize_fp8_ref
from kernels.latent_kv_store import dequantize_latent_ref, latent_row_dtype, quantize_latent_ref

__all__ = ["KVTarget", "PrefillRequest", "KVBegin", "KVLayer", "KVEnd", "KVError", "Frame", "LatentRows",
           "WIRE_FORMATS", "encode_frame", "FrameReader", "encode_layer", "encode_fp8_layer", "decode_layer",
           "KVTransport", "HttpKVTransport", "KV_MEDIA_TYPE"]

WIRE_FORMATS = ("fp8_e4m3", "bf16")
KV_MEDIA_TYPE = "application/x-edgeserve-kv"
_LEN = struct.Struct(">I")


class KVTarget(msgspec.Struct, forbid_unknown_fields=True):
    """Where a direct transfer writes: the decode worker's Transfer Engine (`session_id`, host:port),
    its pool's layout and the pages reserved for this request (in token order). The prefill worker
    starts no write later than `deadline_s` after it received the request."""

    session_id: str
    layout: KVLayout
    page_ids: list[int]
    deadline_s: float


class PrefillRequest(msgspec.Struct, forbid_unknown_fields=True):
    prompt_ids: list[int]
    params: SamplingParams
    request_id: str
    cache_salt: str | None = None
    wire_format: str = "fp8_e4m3"
    kv_target: KVTarget | None = None  # write the pages there directly (else: in the frames)


class KVBegin(msgspec.Struct, tag="begin", tag_field="frame"):
    request_id: str
    first_token: int
    num_tokens: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    wire_format: str
    cached_tokens: int = 0
    generator_state: bytes | None = None  # the seeded sampler's state after the first token
    payload_bytes: int = 0
    direct: bool = False  # the layers are written into the request's `kv_target`, not sent in frames


class KVLayer(msgspec.Struct, tag="layer", tag_field="frame"):
    layer: int
    value_bytes: int  # each of K and V (latent: all the rows)
    scale_bytes: int  # each of K and V exponents (0 for bf16 and latent rows)
    payload_bytes: int
    latent_format: str = ""  # MLA: the latent row format of the payload's rows ("" for K/V)
    kv_lora_rank: int = 0  # MLA: R and Dr of the rows
    rope_dim: int = 0
    index_bytes: int = 0  # DSA: bytes of indexer key rows after the latent rows
    direct_bytes: int = 0  # a direct transfer: bytes this layer wrote into the target (no payload)


class KVEnd(msgspec.Struct, tag="end", tag_field="frame"):
    payload_bytes: int = 0


class KVError(msgspec.Struct, tag="error", tag_field="frame"):
    code: int
    type: str
    message: str
    payload_bytes: int = 0


Frame = KVBegin | KVLayer | KVEnd | KVError
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Frame)


def encode_frame(header: Frame, payload: bytes = b"") -> bytes:
    head = _encoder.encode(header)
    return _LEN.pack(len(head)) + head + payload


class FrameReader:
    """Incremental parser: feed byte chunks as they arrive, take whole frames out."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, chunk: bytes) -> list[tuple[Frame, bytes]]:
        self._buf += chunk
        frames = []
        while len(self._buf) >= _LEN.size:
            (head_len,) = _LEN.unpack_from(self._buf)
            if len(self._buf) < _LEN.size + head_len:
                break
            header = _decoder.decode(bytes(self._buf[_LEN.size:_LEN.size + head_len]))
            end = _LEN.size + head_len + header.payload_bytes
            if len(self._buf) < end:
                break
            frames.append((header, bytes(self._buf[_LEN.size + head_len:end])))
            del self._buf[:end]
        return frames

    @property
    def pending(self) -> int:
        return len(self._buf)


def encode_layer(layer: int, k: torch.Tensor | LatentRows, v: torch.Tensor | None, wire_format: str) -> bytes:
    """One KVLayer frame from K, V [T, kv_heads, head_dim] (any float dtype), or from an MLA
    layer's `LatentRows` (v None)."""
    if isinstance(k, LatentRows):
        return _encode_latent(layer, k, wire_format)
    if wire_format == "fp8_e4m3":
        (kq, ke), (vq, ve) = quantize_fp8_ref(k), quantize_fp8_ref(v)
        return encode_fp8_layer(layer, kq, vq, ke, ve)
    if wire_format != "bf16":
        raise InvalidRequest(f"unknown KV wire format {wire_format!r}; supported: {WIRE_FORMATS}")
    return _encode_parts(layer, [k.to(torch.bfloat16).view(torch.uint8), v.to(torch.bfloat16).view(torch.uint8)])


def encode_fp8_layer(layer: int, k: torch.Tensor, v: torch.Tensor, k_exp: torch.Tensor, v_exp: torch.Tensor
                     ) -> bytes:
    """One FP8 KVLayer frame from K, V [T, kv_heads, head_dim] float8_e4m3fn and their int8 exponents
    [T, kv_heads], as `quantize_fp8_ref` makes them or an FP8 pool stores them (`LLMEngine.read_kv_stored`)."""
    return _encode_parts(layer, [k.view(torch.uint8), v.view(torch.uint8), k_exp, v_exp])


def _encode_parts(layer: int, parts: list[torch.Tensor]) -> bytes:
    """A KVLayer frame of values K, V (and FP8 exponents K, V), each part's bytes in turn."""
    raw = [p.contiguous().cpu().numpy().tobytes() for p in parts]
    value_bytes, scale_bytes = len(raw[0]), len(raw[2]) if len(raw) > 2 else 0
    payload = b"".join(raw)
    return encode_frame(KVLayer(layer, value_bytes, scale_bytes, len(payload)), payload)


def _encode_latent(layer: int, rows: LatentRows, wire_format: str) -> bytes:
    """A KVLayer frame of latent rows: FP8 rows or rows already in the wire format as they are,
    wider rows converted to the wire format (see the module docstring)."""
    if wire_format not in WIRE_FORMATS:
        raise InvalidRequest(f"unknown KV wire format {wire_format!r}; supported: {WIRE_FORMATS}")
    if rows.kv_format not in ("fp8_e4m3", wire_format):
        latent, k_pe = dequantize_latent_ref(rows.rows, rows.kv_lora_rank, rows.rope_dim, rows.kv_format,
                                             torch.float32)
        rows = rows._replace(rows=quantize_latent_ref(latent, k_pe, wire_format), kv_format=wire_format)
    raw = rows.rows.contiguous().cpu().view(torch.uint8).numpy().tobytes()
    index = rows.index_rows.contiguous().cpu().numpy().tobytes() if rows.index_rows is not None else b""
    header = KVLayer(layer, len(raw), 0, len(raw) + len(index), rows.kv_format, rows.kv_lora_rank, rows.rope_dim,
                     len(index))
    return encode_frame(header, raw + index)


def decode_layer(header: KVLayer, payload: bytes, begin: KVBegin) -> tuple[torch.Tensor | LatentRows | None, ...]:
    """(k, v, k_exp, v_exp) tensors of one layer frame; exponents are None for bf16. A latent frame
    gives (LatentRows, None, None, None)."""
    shape = (begin.num_tokens, begin.num_kv_heads, begin.head_dim)
    buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    if header.latent_format:
        t, vb = begin.num_tokens, header.value_bytes
        rows = buf[:vb].view(latent_row_dtype(header.latent_format)).view(t, -1)
        index = buf[vb:vb + header.index_bytes].view(t, -1) if header.index_bytes else None
        return LatentRows(rows, header.latent_format, header.kv_lora_rank, header.rope_dim, index), None, None, None
    vb, sb = header.value_bytes, header.scale_bytes
    if begin.wire_format == "fp8_e4m3":
        k = buf[:vb].view(torch.float8_e4m3fn).view(shape)
        v = buf[vb:2 * vb].view(torch.float8_e4m3fn).view(shape)
        ke = buf[2 * vb:2 * vb + sb].view(torch.int8).view(shape[:2])
        ve = buf[2 * vb + sb:].view(torch.int8).view(shape[:2])
        return k, v, ke, ve
    k = buf[:vb].view(torch.bfloat16).view(shape)
    v = buf[vb:2 * vb].view(torch.bfloat16).view(shape)
    return k, v, None, None


class KVTransport(Protocol):
    """Fetch one request's KV from a prefill worker, frame by frame.

    `fetch` runs the prefill there and yields (header, payload) as frames arrive:
    KVBegin, one KVLayer per layer, KVEnd. A refused or failed prefill raises its
    typed error; a broken transport raises BackendUnavailable. Closing the iterator
    early tells the prefill worker to free its side."""

    def fetch(self, prefill_url: str, request: PrefillRequest) -> AsyncIterator[tuple[Frame, bytes]]: ...

    def target(self, seq: Sequence, deadline_s: float) -> KVTarget | None:
        """Where the prefill worker should write `seq`'s KV directly (its reserved pages), or None:
        send it in the frames."""
        ...


class HttpKVTransport:
    """KV frames in the body of `POST {prefill_url}/v1/prefill` (loopback or a network), sent with
    the worker token when there is one (`worker_auth.py`)."""

    def __init__(self, timeout_s: float = 60.0, token: str | None = None) -> None:
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0),
                                         headers=auth_headers(token))

    async def aclose(self) -> None:
        await self._client.aclose()

    def target(self, seq: Sequence, deadline_s: float) -> KVTarget | None:
        return None

    async def fetch(self, prefill_url: str, request: PrefillRequest) -> AsyncIterator[tuple[Frame, bytes]]:
        url = f"{prefill_url.rstrip('/')}/v1/prefill"
        reader = FrameReader()
        try:
            async with self._client.stream("POST", url, content=msgspec.json.encode(request)) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    raise _http_error(resp)
                async for chunk in resp.aiter_raw():
                    for header, payload in reader.feed(chunk):
                        if isinstance(header, KVError):
                            raise error_from_code(header.code, header.message)
                        yield header, payload
        except httpx.HTTPError as exc:
            raise BackendUnavailable(f"prefill worker {prefill_url} unreachable or transfer broken: {exc}") from exc


def _http_error(resp: httpx.Response) -> EdgeServeError:
    try:
        err = resp.json()["error"]
        return error_from_code(int(err["code"]), str(err["message"]))
    except (ValueError, KeyError, TypeError):
        return BackendUnavailable(f"prefill worker answered HTTP {resp.status_code}: {resp.text[:200]}")
