"""Rank 0 sends each step's batch to the other ranks of its group; they run the model on it.

Rank 0 owns the scheduler: what a step computes is known only there. Before each
forward pass it broadcasts two int64 tensors on the group's control channel:

    header [8]:  kind (STEP or STOP), T tokens, D decode rows, P decode pages per row,
                 C prompt chunks, R logits rows, Q chunk page-table entries in all, phase
                 (0: by rows, 1: prefill weights, 2: decode weights)
    payload [3 T + D P + D + 4 C + Q + R]:
                 input ids [T] | positions [T] | slots [T] | decode page table [D, P] |
                 decode context lengths [D] | per chunk (token_start, num_tokens,
                 context_len, pages) [C, 4] | chunk page tables [Q] | logits rows [R]

Followers rebuild the `StepMetadata` from it (the decode mask from the context lengths,
as the model runner builds it) and run the same forward pass on their shards. Page ids
and slots mean the same on every rank: each rank's KV pool has the same number of pages
(its own KV heads in them), and only rank 0 allocates them.

Other messages share the channel and its header: STOP (sent when the worker shuts down)
ends the followers' loop; the KV exchange of a prefill/decode transfer (`kv_exchange.py`)
sends its own kinds, with header fields and tensors of its own. Rank 0 sends from more
than one thread (the engine's steps, KV transfers), so a message and every collective it
leads to are sent under `lock`: the followers see them in one order. The control channel has
a long timeout (an idle worker sends nothing); a dead rank 0 closes its connections, so
a follower waiting here fails at once.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import torch

from backend.attention import PrefillChunk, StepMetadata
from backend.distributed.collectives import Collectives

__all__ = ["StepMessage", "Message", "StepChannel", "encode_step", "decode_step", "STEP", "STOP", "HEADER"]

STEP, STOP = 1, 2
_PHASES = {None: 0, "prefill": 1, "decode": 2}
_PHASE_NAMES = {v: k for k, v in _PHASES.items()}
HEADER = 8


class Message(NamedTuple):
    """A message other than a step: its kind and the header's other fields (the kind's own tensors follow)."""

    kind: int
    fields: list[int]  # header[1:]


class StepMessage(NamedTuple):
    input_ids: torch.Tensor  # [T] int64
    meta: StepMetadata
    phase: str | None


def encode_step(input_ids: torch.Tensor, meta: StepMetadata, phase: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(header [8], payload) int64 CPU tensors of one step (layout in the module docstring)."""
    d = meta.num_decode
    table = meta.decode_page_table
    p = table.shape[1] if table is not None and d else 0
    chunk_rows = [(c.token_start, c.num_tokens, c.context_len, c.page_table.shape[1]) for c in meta.prefills]
    parts = [input_ids, meta.positions, meta.slots]
    if d:
        parts += [table.reshape(-1), meta.decode_context_lens.long()]
    parts.append(torch.tensor(chunk_rows, dtype=torch.int64).reshape(-1))
    parts += [c.page_table.reshape(-1) for c in meta.prefills]
    parts.append(meta.logits_rows)
    payload = torch.cat([t.to(device="cpu", dtype=torch.int64) for t in parts])
    q = sum(r[3] for r in chunk_rows)
    header = torch.tensor([STEP, input_ids.shape[0], d, p, len(chunk_rows), meta.logits_rows.shape[0], q,
                           _PHASES[phase]], dtype=torch.int64)
    return header, payload


def decode_step(header: torch.Tensor, payload: torch.Tensor, page_size: int, dtype: torch.dtype,
                device: torch.device | str) -> StepMessage:
    """The step `encode_step` sent, its tensors on `device` (the decode mask in `dtype`)."""
    _, t, d, p, c, r, q, phase = header.tolist()
    payload = payload.to(device)
    at = 0

    def take(n: int) -> torch.Tensor:
        nonlocal at
        at += n
        return payload[at - n: at]

    input_ids, positions, slots = take(t), take(t), take(t)
    table = lens = None
    if d:
        table = take(d * p).view(d, p)
        lens = take(d).to(torch.int32)
    rows = take(4 * c).view(c, 4).tolist()
    chunks = [PrefillChunk(token_start=a, num_tokens=n, context_len=ctx, page_table=take(pages).view(1, pages))
              for a, n, ctx, pages in rows]
    meta = StepMetadata(positions=positions, slots=slots, num_decode=d, decode_page_table=table,
                        decode_context_lens=lens, prefills=chunks, logits_rows=take(r), page_size=page_size,
                        mask_dtype=dtype)
    return StepMessage(input_ids, meta, _PHASE_NAMES[phase])


class StepChannel:
    """Rank 0's `send` and the followers' `recv` of messages over the control channel."""

    def __init__(self, collectives: Collectives, page_size: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        self.coll = collectives
        self.page_size, self.dtype, self.device = page_size, dtype, device
        self.comm_device = "cuda" if str(device).startswith("cuda") else "cpu"  # NCCL needs device tensors
        self.lock = threading.RLock()  # rank 0: held from a message's header to its last collective

    def send(self, input_ids: torch.Tensor, meta: StepMetadata, phase: str | None) -> None:
        """Rank 0, under `lock` with the forward pass it announces: one step."""
        header, payload = encode_step(input_ids, meta, phase)
        self.coll.broadcast(header.to(self.comm_device))
        self.coll.broadcast(payload.to(self.comm_device))

    def send_message(self, kind: int, fields: list[int], *tensors: torch.Tensor) -> None:
        """Rank 0, under `lock`: a header (kind, fields) then each tensor, broadcast as they are."""
        header = torch.zeros(HEADER, dtype=torch.int64)
        header[0] = kind
        header[1: 1 + len(fields)] = torch.tensor(fields, dtype=torch.int64)
        self.coll.broadcast(header.to(self.comm_device))
        for t in tensors:
            self.coll.broadcast(t.contiguous().to(self.comm_device))

    def send_stop(self) -> None:
        """Rank 0: end the followers' loop."""
        with self.lock:
            self.send_message(STOP, [])

    def recv_tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A follower: the next tensor of the current message (its shape and dtype known from the header)."""
        return self.coll.broadcast(torch.empty(shape, dtype=dtype, device=self.comm_device))

    def recv(self) -> StepMessage | Message | None:
        """A follower: the next step, another kind of message (its tensors still to `recv_tensor`), or
        None when rank 0 sent STOP."""
        header = self.coll.broadcast(torch.zeros(HEADER, dtype=torch.int64, device=self.comm_device)).cpu()
        kind = int(header[0])
        if kind == STOP:
            return None
        if kind != STEP:
            return Message(kind, header[1:].tolist())
        _, t, d, p, c, r, q, _ = header.tolist()
        payload = self.recv_tensor((3 * t + d * p + d + 4 * c + q + r,), torch.int64)
        return decode_step(header, payload, self.page_size, self.dtype, self.device)
