"""Starting a tensor-parallel worker group, the followers' loop, and ending it when a rank dies.

Two ways to start N ranks (gloo on CPU, NCCL on CUDA):

- spawned by the worker: `edgeserve serve --tensor-parallel N` picks a free TCP port on
  127.0.0.1, starts ranks 1..N-1 as child processes (`multiprocessing` spawn), and is
  rank 0 itself (`start_group`);
- under `torchrun --nproc-per-node N -m ops.cli serve --tensor-parallel N ...`: every rank
  runs the same command, reads RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT from the
  environment (`init_method="env://"`); rank 0 serves HTTP, the others run the follower
  loop (`run_follower`) and exit when it ends.

Rank 0 owns the HTTP API, the scheduler, sampling, the integrity check and registration;
the followers hold only their shard and their KV pool, and run each step rank 0 sends
(`step_broadcast.py`). Two process groups: the default one carries the model's
collectives with a short timeout (`timeout_s`: a hung rank fails the step), the control
one carries the step messages with a long one (an idle worker sends nothing for hours).

Ending: a rank that dies closes its connections, so the next collective on the others
raises at once (`GroupFailure`); in spawn mode rank 0 also watches its children
(`Watchdog`) so a follower that dies while the worker is idle ends the group too, without
waiting for the next step. Rank 0's engine then stops: in-flight requests end with the
typed `GroupFailure` (an `EngineStopped`), the worker leaves the registry and /health
turns 503 "failed"; followers see rank 0's connections close and exit. Under torchrun
the launcher also tears the whole group down when any rank exits. Restarting the
command brings the group back.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing
import multiprocessing.connection
import os
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from backend.distributed import kernel_choices
from backend.distributed.collectives import Collectives
from backend.distributed.kv_exchange import KVExchange, serve_kv_message
from backend.distributed.step_broadcast import StepChannel, StepMessage
from backend.errors import ModelLoadError
from backend.heap import freeze_heap

if TYPE_CHECKING:
    from backend.engine import EngineConfig, LLMEngine

__all__ = ["GroupSpec", "LeaderGroup", "start_group", "init_rank", "run_follower", "follower_main",
           "attach_leader", "free_port", "torchrun_env", "CONTROL_TIMEOUT_S"]

log = logging.getLogger(__name__)

CONTROL_TIMEOUT_S = 365 * 24 * 3600.0  # step messages: an idle worker may send none for a long time


@dataclass
class GroupSpec:
    """What every rank needs to load its shard and join the group (picklable: sent to spawned ranks)."""

    world_size: int
    model_dir: str
    config: EngineConfig
    expert_parallel: bool = False
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: choose a free port (spawn mode)
    timeout_s: float = 60.0  # the model's collectives: a rank silent this long fails the step


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (the rendezvous port of a spawned group)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def torchrun_env() -> tuple[int, int] | None:
    """(rank, world size) when this process was launched by torchrun (RANK and WORLD_SIZE set)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def init_rank(rank: int, spec: GroupSpec, env: bool = False) -> Collectives:
    """Join the group as `rank`: the default process group (model collectives, `spec.timeout_s`) and
    the control group (step messages, `CONTROL_TIMEOUT_S`). `env`: rendezvous from torchrun's variables.
    On CPU the ranks then take rank 0's timed kernel choices (`kernel_choices.py`), before any loads."""
    backend = "nccl" if spec.config.device == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    init = "env://" if env else f"tcp://{spec.master_addr}:{spec.master_port}"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=spec.world_size,
                            timeout=datetime.timedelta(seconds=spec.timeout_s))
    control = dist.new_group(backend=backend, timeout=datetime.timedelta(seconds=CONTROL_TIMEOUT_S))
    coll = Collectives(rank, spec.world_size, control)
    if backend == "gloo":
        kernel_choices.agree(coll)
    return coll


def _load_shard(spec: GroupSpec, coll: Collectives) -> Any:
    """This rank's shard of the model (`backend.model.load_model` with the group)."""
    from backend.engine import DTYPES
    from backend.model import load_model

    c = spec.config
    return load_model(Path(spec.model_dir), DTYPES[c.dtype], c.gemm_buckets, c.device, c.prefill_weights,
                      c.decode_weights, c.int4_group_size, group=coll, expert_parallel=spec.expert_parallel,
                      lm_head_weights=c.lm_head_weights)


def _handshake(coll: Collectives, model: Any, num_pages: int) -> None:
    """Once every rank holds its shard and KV pool: check that each pool has rank 0's page count (page
    ids are rank 0's) and record every rank's weight figures in `coll.rank_weights` (raise on a mismatch)."""
    pages = coll.broadcast(torch.tensor([num_pages], dtype=torch.int64))
    memory = model.weight_memory()
    mine = torch.tensor([1 if int(pages[0]) == num_pages else 0, model.bytes_read, memory["total"] - memory["packs"]],
                        dtype=torch.int64)
    every = [torch.zeros_like(mine) for _ in range(coll.world)]
    dist.all_gather(every, mine, group=coll.control)
    coll.rank_weights = [{"bytes_read": int(t[1]), "bytes_held": int(t[2])} for t in every]
    if not all(int(t[0]) for t in every):
        raise ModelLoadError(f"the ranks' KV pools differ in pages (rank 0 has {int(pages[0])}); every rank needs "
                             f"the same --kv-cache-bytes")


def run_follower(coll: Collectives, spec: GroupSpec) -> int:
    """A follower rank: load the shard and a KV pool, then run every step rank 0 sends until STOP.
    Returns the number of steps run."""
    from backend.kv_cache import create_kv_cache

    c = spec.config
    if c.num_threads:
        torch.set_num_threads(c.num_threads)
    model = _load_shard(spec, coll)
    cache = create_kv_cache(model.local_cfg, c.kv_format, c.kv_cache_bytes, c.page_size, model.dtype,
                            model.embed.device)
    _handshake(coll, model, cache.num_pages)
    channel = StepChannel(coll, c.page_size, model.dtype, c.device)
    freeze_heap()  # as rank 0 does before serving: a full collection here would stall every rank's step
    steps = 0
    while (msg := channel.recv()) is not None:
        if isinstance(msg, StepMessage):
            model.forward_local(msg.input_ids, msg.meta, cache, msg.phase)
            steps += 1
        else:  # a KV transfer's read or install (kv_exchange.py)
            serve_kv_message(msg, channel, cache, model.kv_heads[coll.rank])
    return steps


def follower_main(rank: int, spec: GroupSpec) -> None:
    """Entry point of a spawned follower rank (exit code 0 after STOP, 1 when the group broke)."""
    logging.basicConfig(level=logging.INFO, format=f"rank {rank}: %(levelname)s %(message)s")
    try:
        coll = init_rank(rank, spec)
        run_follower(coll, spec)
    except BaseException as exc:  # noqa: BLE001 - a follower reports and exits; rank 0 sees the group end
        log.error("follower rank %d stops: %s", rank, exc)
        os._exit(1)
    dist.destroy_process_group()


def attach_leader(engine: LLMEngine, coll: Collectives) -> None:
    """Rank 0: have `engine`'s model send every step to the followers, once every rank holds its shard
    and a KV pool of the same page count, and give the engine its `KVExchange` for KV transfers."""
    _handshake(coll, engine.model, engine.cache.num_pages)
    channel = StepChannel(coll, engine.cache.page_size, engine.model.dtype, engine.config.device)
    engine.model.step_channel = channel
    engine.kv_exchange = KVExchange(channel, engine.cache, engine.model.kv_heads)


class Watchdog:
    """Rank 0 in spawn mode: marks the group failed as soon as a follower process exits."""

    def __init__(self, coll: Collectives, procs: dict[int, multiprocessing.process.BaseProcess]) -> None:
        self.coll, self.procs = coll, procs
        self.stopping = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="edgeserve-tp-watchdog", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        sentinels = {p.sentinel: r for r, p in self.procs.items()}
        ready = multiprocessing.connection.wait(list(sentinels))
        if self.stopping.is_set():
            return
        rank = sentinels[ready[0]]  # type: ignore[index]
        proc = self.procs[rank]
        proc.join(timeout=1)
        log.error("tensor-parallel rank %d (pid %s) exited with code %s: ending the group", rank, proc.pid,
                  proc.exitcode)
        self.coll.fail(f"rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}")


class LeaderGroup:
    """Rank 0's handle on its group: the collectives, the spawned followers (spawn mode) and `shutdown`."""

    def __init__(self, coll: Collectives, procs: dict[int, multiprocessing.process.BaseProcess]) -> None:
        self.coll = coll
        self.procs = procs  # rank -> process (empty under torchrun)
        self.watchdog = Watchdog(coll, procs) if procs else None

    @property
    def pids(self) -> dict[int, int | None]:
        """Follower rank -> process id (spawn mode)."""
        return {r: p.pid for r, p in self.procs.items()}

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the followers (STOP when the group still works, else kill what is left) and leave the group."""
        if self.watchdog is not None:
            self.watchdog.stopping.set()
        if self.coll.failure is None:
            try:
                StepChannel(self.coll, 1, torch.float32).send_stop()
            except Exception:  # noqa: BLE001 - a broken group: the followers are killed below
                log.warning("could not send STOP to the followers")
        for p in self.procs.values():
            p.join(timeout_s)
            if p.is_alive():
                p.kill()
                p.join(timeout_s)
        if dist.is_initialized():
            dist.destroy_process_group()


def start_group(spec: GroupSpec) -> LeaderGroup | None:
    """Start (spawn mode) or join (under torchrun) the group of `spec.world_size` ranks.

    Returns rank 0's `LeaderGroup`; a torchrun follower runs `run_follower` to the end and gets None."""
    launched = torchrun_env()
    if launched is not None:
        rank, world = launched
        if world != spec.world_size:
            raise ModelLoadError(f"torchrun started {world} ranks, --tensor-parallel asks for {spec.world_size}")
        coll = init_rank(rank, spec, env=True)
        if rank != 0:
            try:
                run_follower(coll, spec)
            finally:
                dist.destroy_process_group()
            return None
        return LeaderGroup(coll, {})
    if not spec.master_port:
        spec.master_port = free_port(spec.master_addr)
    ctx = multiprocessing.get_context("spawn")
    procs = {r: ctx.Process(target=follower_main, args=(r, spec), name=f"edgeserve-tp-rank{r}", daemon=True)
             for r in range(1, spec.world_size)}
    for p in procs.values():
        p.start()
    try:
        coll = init_rank(0, spec)
    except BaseException:
        for p in procs.values():
            p.kill()
        raise
    return LeaderGroup(coll, procs)
