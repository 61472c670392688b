"""The collective calls a tensor-parallel model makes, counted, on `torch.distributed`.

Per step of a dense model of L layers at world size N: one all-reduce of the
embedding lookup (vocab-parallel: each rank contributes the rows of its own ids),
two all-reduces per layer (after attention's row-parallel o_proj and after the MLP's
row-parallel down_proj, or the MoE block's partial sums), and one gather of the
vocab-parallel logits to rank 0: 2 L + 2 calls. All-reduces sum in the tensor's dtype
(float32 by default); the summation order differs from one process's GEMM, so logits
agree with world size 1 to float rounding (~1e-6 in float32), not bit for bit.

Failures: a rank that dies closes its connections and the next collective on every
other rank raises at once; a rank that hangs makes it raise after the group's
timeout. Either way the error surfaces as `GroupFailure` (an `EngineStopped`), and
the group is marked failed: every later call raises it too (`check`). Whoever must
act on it at once registers with `on_failure` (rank 0's `AsyncEngine` ends its
streams): a collective that waits on a dead rank may only raise at the timeout.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable

import torch
import torch.distributed as dist

from backend.errors import EngineStopped

__all__ = ["Collectives", "GroupFailure"]

log = logging.getLogger(__name__)


class GroupFailure(EngineStopped):
    """A rank of this worker's tensor-parallel group died or stopped answering: the group is over."""


class Collectives:
    """Counted collectives of one rank on the default process group (`compute`) and on the group
    that carries rank 0's step messages (`control`, whose waits may be long: an idle worker)."""

    def __init__(self, rank: int, world: int, control: object | None = None) -> None:
        self.rank, self.world = rank, world
        self.control = control  # a torch.distributed group handle (None: the default group)
        self.calls: Counter[str] = Counter()  # collective kind -> calls
        self.bytes: Counter[str] = Counter()  # collective kind -> bytes this rank sent into it
        self.failure: GroupFailure | None = None
        self.rank_weights: list[dict[str, int]] = []  # per rank: checkpoint bytes read, weight bytes held
        self._lock = threading.Lock()
        self._listeners: list[Callable[[GroupFailure], None]] = []  # called once, at the first failure

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def fail(self, reason: str) -> GroupFailure:
        """Mark the group failed (first reason wins) and return the error every later call raises. The first
        call also calls the `on_failure` listeners, on this thread (the watchdog's, or the one whose
        collective raised)."""
        with self._lock:
            listeners: list[Callable[[GroupFailure], None]] = []
            if self.failure is None:
                self.failure = GroupFailure(f"the tensor-parallel group of this worker is gone: {reason}; "
                                            f"retry on another worker", world_size=self.world)
                listeners, self._listeners = self._listeners, []
            failure = self.failure
        for listener in listeners:  # outside the lock: a listener may ask `check` or `failure`
            try:
                listener(failure)
            except Exception:  # noqa: BLE001 - the others must still hear of it
                log.exception("a listener of the group's failure raised")
        return failure

    def on_failure(self, listener: Callable[[GroupFailure], None]) -> None:
        """Call `listener(failure)` once when the group fails; at once, here, if it already has. It runs on the
        thread that marks the failure and must not wait on the group."""
        with self._lock:
            failure = self.failure
            if failure is None:
                self._listeners.append(listener)
        if failure is not None:
            listener(failure)

    def check(self) -> None:
        """Raise the group's `GroupFailure` once it has failed."""
        if self.failure is not None:
            raise self.failure

    def _run(self, kind: str, nbytes: int, op: object, *args: object, **kwargs: object) -> None:
        self.check()
        self.calls[kind] += 1
        self.bytes[kind] += nbytes
        try:
            op(*args, **kwargs)  # type: ignore[operator]
        except (RuntimeError, ValueError) as exc:  # gloo: "Connection closed by peer", timeouts
            raise self.fail(f"{kind} failed on rank {self.rank}: {str(exc).splitlines()[0][:300]}") from exc

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place; returns it."""
        self._run("all_reduce", t.nbytes, dist.all_reduce, t)
        return t

    def gather_columns(self, local: torch.Tensor, total: int, shard: int) -> torch.Tensor | None:
        """Rank 0: the [R, total] concatenation of every rank's columns local [R, n_r] (each padded to
        `shard` columns for the gather, n_r <= shard, in rank order); the other ranks get None."""
        padded = local.new_zeros(local.shape[0], shard)
        padded[:, : local.shape[1]] = local
        parts = [torch.empty_like(padded) for _ in range(self.world)] if self.is_leader else None
        self._run("gather", padded.nbytes, dist.gather, padded, parts, dst=0)
        if parts is None:
            return None
        sizes = [(r + 1) * total // self.world - r * total // self.world for r in range(self.world)]
        return torch.cat([p[:, :n] for p, n in zip(parts, sizes)], dim=1)

    def gather(self, t: torch.Tensor, control: bool = True) -> list[torch.Tensor] | None:
        """Rank 0: every rank's `t` (equal shapes), in rank order; the others get None. On the control
        group by default (a KV transfer's gather may wait behind a long step)."""
        parts = [torch.empty_like(t) for _ in range(self.world)] if self.is_leader else None
        self._run("gather", t.nbytes, dist.gather, t, parts, dst=0, group=self.control if control else None)
        return parts

    def broadcast(self, t: torch.Tensor, control: bool = True) -> torch.Tensor:
        """Rank 0's `t` into every rank's `t` (same shape and dtype), on the control group by default."""
        self._run("broadcast", t.nbytes if self.is_leader else 0, dist.broadcast, t, 0,
                  group=self.control if control else None)
        return t

    def snapshot(self) -> dict[str, dict[str, int]]:
        """Calls and bytes per kind so far (copies)."""
        return {"calls": dict(self.calls), "bytes": dict(self.bytes)}
