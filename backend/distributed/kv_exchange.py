"""A tensor-parallel worker's side of a prefill -> decode KV transfer: rank 0 gathers and scatters.

Each rank's KV pool holds only its KV heads (`sharding.py`), but the transfer protocol
(`backend/kv_transfer.py`) moves whole layers, [T, kv_heads, head_dim] in token order, between
one prefill and one decode worker. So a worker group speaks it through rank 0 and the wire
never knows how either side is split:

- **read** (a prefill group sending): rank 0 sends READ_KV (layer, the prompt's slots); every
  rank reads its heads at those slots (dequantised to the compute dtype, as `read_tokens` does)
  and they are gathered to rank 0, which lays them out as the model's whole KV heads (a head
  replicated on several ranks is taken once). Rank 0 then quantises for the wire as a single
  worker does.
- **install** (a decode group receiving): rank 0 sends INSTALL_KV (layer, slots) and the whole
  layer as received (FP8 bytes with their exponents, or float32); every rank writes its own
  heads' columns (`write_tokens`: FP8 copied byte for byte).
- **latent rows** (MLA, replicated on every rank): a read needs no message (rank 0's rows are
  everyone's); an install is written by rank 0 in its pool format, read back, and its bytes sent
  (INSTALL_ROWS) so every rank holds exactly rank 0's rows. A DSA model's indexer key rows
  (replicated like the latent rows) travel in the same message after them.

So groups of any sizes pair up (TP 2 prefill with TP 1 or TP 4 decode): only the rank 0s talk
to each other. One gather or two broadcasts of the layer per layer: rank 0's link carries the
whole KV, which is the cost of not teaching the wire protocol about shards.
"""

from __future__ import annotations

import torch

from backend.distributed.step_broadcast import Message, StepChannel
from backend.latent_kv_cache import LatentRows

__all__ = ["KVExchange", "serve_kv_message", "READ_KV", "INSTALL_KV", "INSTALL_ROWS"]

READ_KV, INSTALL_KV, INSTALL_ROWS = 3, 4, 5
_FP8 = torch.float8_e4m3fn


class KVExchange:
    """Rank 0's KV reads and installs over its group (see the module docstring)."""

    def __init__(self, channel: StepChannel, cache: object, kv_heads: list[range]) -> None:
        self.channel, self.cache, self.kv_heads = channel, cache, kv_heads  # kv_heads: per rank
        self.num_kv_heads = max(r.stop for r in kv_heads)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [T, kv_heads (all of them), head_dim] at slots [T], in the compute dtype."""
        with self.channel.lock:
            self.channel.send_message(READ_KV, [slots.shape[0], layer], slots.to(torch.int64))
            k, v = self.cache.read_tokens(layer, slots)  # [T, local kv heads, head_dim]
            parts = self.channel.coll.gather(torch.stack([k, v]).float().to(self.channel.comm_device))
        t, _, hd = k.shape
        full = torch.empty(2, t, self.num_kv_heads, hd, dtype=torch.float32)
        for heads, part in zip(self.kv_heads, parts or []):
            full[:, :, heads.start: heads.stop] = part.cpu()
        full = full.to(device=k.device, dtype=k.dtype)
        return full[0], full[1]

    def install(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> None:
        """Write the whole layer's K, V [T, kv_heads, head_dim] (FP8 with int8 exponents [T, kv_heads],
        or any float dtype) at slots [T]: each rank its own heads."""
        t, h, hd = k.shape
        fp8 = k_scale is not None and k.dtype == _FP8
        tensors = [slots.to(torch.int64)]
        if fp8:
            tensors += [k.view(torch.uint8), v.view(torch.uint8), k_scale.to(torch.int8), v_scale.to(torch.int8)]
        else:
            tensors += [k.float(), v.float()]
        with self.channel.lock:
            self.channel.send_message(INSTALL_KV, [t, layer, h, hd, int(fp8)], *tensors)
            _write_heads(self.cache, layer, self.kv_heads[0], tensors, fp8)

    def install_rows(self, layer: int, slots: torch.Tensor, rows: LatentRows) -> None:
        """Write an MLA layer's latent rows (and a DSA model's indexer key rows) at slots [T] on every
        rank (rank 0's pool bytes)."""
        with self.channel.lock:
            self.cache.write_rows(layer, slots, rows)
            mine = self.cache.read_rows(layer, slots)
            raw = mine.rows.contiguous().view(torch.uint8)  # [T, row bytes] of the pool's rows
            tensors = [slots.to(torch.int64), raw]
            if mine.index_rows is not None:
                tensors.append(mine.index_rows.contiguous())  # [T, indexer row bytes] uint8
            index_bytes = mine.index_rows.shape[1] if mine.index_rows is not None else 0
            self.channel.send_message(INSTALL_ROWS, [raw.shape[0], layer, raw.shape[1], index_bytes], *tensors)


def _write_heads(cache: object, layer: int, heads: range, tensors: list[torch.Tensor], fp8: bool) -> None:
    """Write this rank's `heads` of a whole layer sent as [slots, k, v(, k_exp, v_exp)]."""
    slots, k, v = tensors[0], tensors[1], tensors[2]
    cols = slice(heads.start, heads.stop)
    if fp8:
        k_exp, v_exp = tensors[3], tensors[4]
        cache.write_tokens(layer, slots, k[:, cols].contiguous().view(_FP8), v[:, cols].contiguous().view(_FP8),
                           k_exp[:, cols].contiguous(), v_exp[:, cols].contiguous())
    else:
        cache.write_tokens(layer, slots, k[:, cols].contiguous(), v[:, cols].contiguous())


def serve_kv_message(msg: Message, channel: StepChannel, cache: object, heads: range) -> None:
    """A follower: answer one KV message of rank 0 (`heads`: this rank's KV heads)."""
    recv = channel.recv_tensor
    if msg.kind == READ_KV:
        t, layer = msg.fields[:2]
        slots = recv((t,), torch.int64)
        k, v = cache.read_tokens(layer, slots)
        channel.coll.gather(torch.stack([k, v]).float().to(channel.comm_device))
    elif msg.kind == INSTALL_KV:
        t, layer, h, hd, fp8 = msg.fields[:5]
        slots = recv((t,), torch.int64)
        if fp8:
            tensors = [slots, recv((t, h, hd), torch.uint8), recv((t, h, hd), torch.uint8),
                       recv((t, h), torch.int8), recv((t, h), torch.int8)]
        else:
            tensors = [slots, recv((t, h, hd), torch.float32), recv((t, h, hd), torch.float32)]
        _write_heads(cache, layer, heads, tensors, bool(fp8))
    elif msg.kind == INSTALL_ROWS:
        t, layer, row_bytes, index_bytes = msg.fields[:4]
        slots = recv((t,), torch.int64)
        raw = recv((t, row_bytes), torch.uint8)
        index_rows = recv((t, index_bytes), torch.uint8) if index_bytes else None
        rows = raw.view(cache.pages.dtype)  # [T, row_elems]
        cache.write_rows(layer, slots, LatentRows(rows, cache.format_name, cache.kv_lora_rank, cache.rope_dim,
                                                  index_rows))
    else:
        raise ValueError(f"unknown message kind {msg.kind} from rank 0")
