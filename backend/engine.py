"""The engine core: one step = schedule() -> run() -> postprocess().

`LLMEngine` is synchronous and single-threaded (the engine thread); requests
enter through the scheduler's thread-safe `add`/`abort`. Each step returns
`StepOutput`s: a new token, a finish, or both.

Disaggregated roles use the same engine: a prefill worker runs requests with
`max_tokens=1` and `hold=True` and reads their KV out (`read_kv`) before
`release_held`; a decode worker `reserve`s pages, `install_kv`s what arrives and
`activate`s the request, whose first token (sampled by the prefill worker) is
emitted at the next step.

A step's failure is confined to it when it comes from running its batch (the
integrity check, the model, sampling and bookkeeping): that batch's requests end
with the error, their pages return, `failed_steps_in_row` counts it and the next
step goes on. A failure before the batch is known (taking activations, expiring
held pages, scheduling) escapes `step()`: the caller (`AsyncEngine`) stops then.

Other threads read the engine only through `snapshot()`: one-`len` counts (running,
waiting, held, free pages) live, everything that needs iterating engine-thread
structures (the prefix cache, queued prompt tokens, counters) as the values the
engine thread last `publish`ed: at the end of a step at most every
`PUBLISH_INTERVAL_S` while busy, always at the end of the step that leaves it idle,
and (under `AsyncEngine`) whenever the idle thread wakes, e.g. after held pages are freed.

Tensor parallelism (`backend/distributed/`): built with a group (`from_pretrained(...,
group=...)`), this engine is rank 0: its model sends every forward pass to the other
ranks, and `read_kv` / `install_kv` move the whole model's KV heads through rank 0
(`distributed/kv_exchange.py`). A `GroupFailure` (a rank died or hung) ends the failing batch's requests with it,
like any step failure, and marks the group failed (the watchdog marks it too when a rank
dies while idle). The next `step()` then ends every request left with it and closes the
scheduler, and `has_work()` raises it from then on, so `AsyncEngine` stops.

Prefix-cache KV events (`kv_events`, drained by the worker's Redis publisher) are
bounded by `EngineConfig.kv_events_max`: when nobody drains them the oldest are
dropped and counted in `kv_events_dropped`, so a publisher can tell its index is stale.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch

from backend.config import ModelConfig
from backend.decode_graphs import DecodeGraphs, graphs_supported
from backend.distributed.collectives import Collectives
from backend.errors import EdgeServeError, InvalidRequest, InvalidSamplingParams, KVIntegrityError
from backend.grammar import GrammarCompiler
from backend.kv_cache import create_kv_cache
from backend.latent_kv_cache import LatentKVCache, LatentRows
from backend.linear import DEFAULT_BUCKETS
from backend.model import DecoderModel, load_model
from backend.model_runner import ModelRunner
from backend.page_allocator import PageAllocator
from backend.prefix_cache_pool import KVEvent, PrefixCachePool
from backend.logprobs import logprobs_of
from backend.protocol import Logprobs
from backend.sampler import sample
from backend.sampling_params import SamplingParams
from backend.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from backend.sequence import Sequence, SequenceStatus
from backend.step_integrity import StepIntegrity
from backend.stop_checker import StopChecker
from kernels import cpu_gemv
from kernels.cpu_threads import torch_single_threaded

__all__ = ["EngineConfig", "StepOutput", "TokenScores", "LLMEngine", "PUBLISH_INTERVAL_S"]

log = logging.getLogger(__name__)

PUBLISH_INTERVAL_S = 0.05  # while busy, `snapshot()`'s published values are at most this old (plus one step)

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}


@dataclass
class EngineConfig:
    dtype: str = "float32"  # compute dtype; float32 is the fast one on CPUs without BF16 units
    kv_format: str = "fp32"
    gemm_buckets: tuple[int, ...] = DEFAULT_BUCKETS  # MKL-packed row counts (float32 CPU only)
    device: str = "cpu"  # "cuda": Triton kernels for KV store and decode attention
    integrity_check: bool = True  # batched page-tag check before every step (kernels/integrity.py)
    kv_cache_bytes: int = 256 * 2**20
    page_size: int = 16
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    prefill_chunk_size: int = 256
    max_waiting: int = 256
    # tokens a step with decode rows holds at most (scheduler.py); None: `cpu_gemv.mixed_step_tokens()` where every
    # linear runs the bf16 C GEMV, else no cap; 0: no cap
    mixed_step_tokens: int | None = None
    num_threads: int | None = None  # torch intra-op threads (None: leave as is)
    prefix_caching: bool = False  # share full prompt blocks between requests (prefill and unified roles)
    held_timeout_s: float = 60.0  # prefill role: pages of a request whose KV is never collected are freed
    # linear-layer weight formats per phase (backend/weight_formats.py): fp32 | bf16 | fp8 | int4; None keeps
    # the checkpoint's (dense: in the compute dtype). Equal formats share one copy; different ones hold two.
    prefill_weights: str | None = None  # rows of prompt tokens
    decode_weights: str | None = None  # rows of decode tokens, in every step (mixed ones too)
    int4_group_size: int = 128  # 32 allowed
    # "int8": an 8-bit copy of the LM head runs calls of few logits rows (decode steps of a few requests), up to
    # where it measured faster at load (backend/lm_head.py; perplexity +0.1% on SmolLM2); None: the head as loaded
    lm_head_weights: str | None = None
    kv_events_max: int = 10_000  # prefix-cache KV events kept for the publisher; older ones are dropped
    tensor_parallel: int = 1  # ranks of this worker's group (backend/distributed/); 1: one process, no collectives
    expert_parallel: bool = False  # with tensor_parallel > 1: routed experts split by whole experts
    # pure decode steps replay CUDA graphs (backend/decode_graphs.py; on a CPU the same padded steps run eagerly).
    # None: on with a CUDA device (an H200 run gave the eager steps' tokens, 7.6x the decode tok/s at c = 1 and
    # 2.9x at c = 32 in bfloat16), off on the CPU (no launches to save)
    cuda_graphs: bool | None = None


class TokenScores(NamedTuple):
    logprobs: torch.Tensor  # [len - 1] float32: log p(token i + 1 | tokens ..i)
    top1: torch.Tensor  # [len - 1] bool: token i + 1 was the argmax
    dist: torch.Tensor | None = None  # [len - 1, vocab] log-probabilities of every token (when asked)


class StepOutput(NamedTuple):
    seq: Sequence
    new_token: int | None  # None when the sequence only finished (cancelled, failed)
    token_time: float
    finished: bool
    error: EdgeServeError | None = None  # set when the step failed for this sequence
    logprobs: Logprobs | None = None  # of new_token, when the request asks (params.logprobs)
    prompt_logprobs: Logprobs | None = None  # of prompt tokens 1.., once, when its prompt completed


class LLMEngine:
    def __init__(self, model: DecoderModel, config: EngineConfig, tokenizer: object | None = None) -> None:
        self.model = model
        self.config = config
        cfg: ModelConfig = model.cfg
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.max_model_len = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.cache = create_kv_cache(model.local_cfg, config.kv_format, config.kv_cache_bytes, config.page_size,
                                     model.dtype, model.embed.device)
        self.allocator = PageAllocator(self.cache.num_pages, model.embed.device)  # tags where the check runs
        # prefix-cache blocks stored/removed, for the worker to publish (popleft); bounded, drops counted
        self.kv_events: deque[KVEvent] = deque(maxlen=config.kv_events_max)
        self.kv_events_dropped = 0
        self.scheduler = Scheduler(
            SchedulerConfig(max_model_len=self.max_model_len, max_num_seqs=config.max_num_seqs,
                            max_num_batched_tokens=max(config.max_num_batched_tokens, config.max_num_seqs),
                            prefill_chunk_size=config.prefill_chunk_size, max_waiting=config.max_waiting),
            self.allocator, config.page_size,
            PrefixCachePool(self.allocator, config.page_size, self._record_kv_event) if config.prefix_caching
            else None)
        self.runner = ModelRunner(model, self.cache)
        if config.cuda_graphs or (config.cuda_graphs is None and model.embed.device.type == "cuda"):
            self._setup_graphs()
        mixed = config.mixed_step_tokens
        if mixed is None and self.runner.gemv_decode and self.runner.gemv_dtype == torch.bfloat16:
            mixed = cpu_gemv.mixed_step_tokens()  # (float32 prompts keep MKL's GEMM: no cap for them)
        if mixed:
            self.scheduler.config = replace(self.scheduler.config, mixed_step_tokens=mixed)
        self.group: Collectives | None = model.group  # rank 0 of a tensor-parallel group, or None
        self.kv_exchange: Any = None  # with a group: KV transfers read/write every rank's heads (kv_exchange.py)
        if self.group is not None:
            from backend.distributed.group import attach_leader

            attach_leader(self, self.group)
        self._group_ended = False  # every request was ended with the group's failure
        self.integrity = StepIntegrity(self.allocator)  # the page-tag check before each step's model call
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(getattr(tokenizer, "eos_token_ids", None) or cfg.eos_token_ids)
        self._stop_checkers: dict[str, StopChecker] = {}
        self._grammars: GrammarCompiler | None = None  # built on the first grammar request
        self.stats: dict[str, Any] = {"steps": 0, "prompt_tokens": 0, "generated_tokens": 0, "finished": 0,
                                       "cancelled": 0, "failed": 0, "integrity_checks": 0, "integrity_check_s": 0.0,
                                       "held_expired": 0,
                                       "grammar_advances": 0, "grammar_advance_s": 0.0,
                                       "integrity_aborts_by_cause": {"tag_mismatch": 0, "invalid_page": 0,
                                                                     "overwritten": 0}}
        self.failed_steps_in_row = 0  # steps whose batch failed since the last one that ran
        self._published: dict[str, object] = {}
        self._published_at = 0.0
        self.publish(force=True)

    @classmethod
    def from_pretrained(cls, model_dir: Path, config: EngineConfig | None = None,
                        group: Collectives | None = None) -> LLMEngine:
        """Load `model_dir` and build the engine; with `group` (rank 0's collectives of a group of
        `config.tensor_parallel` ranks whose followers load their shards too) only rank 0's shard."""
        config = config or EngineConfig()
        if (config.tensor_parallel > 1) != (group is not None and group.world > 1) or \
                (group is not None and group.world != config.tensor_parallel):
            raise InvalidRequest(f"tensor_parallel {config.tensor_parallel} needs a group of that many ranks "
                                 f"(backend.distributed.group.start_group); got "
                                 f"{'none' if group is None else group.world}")
        model = load_model(Path(model_dir), DTYPES[config.dtype], config.gemm_buckets, config.device,
                           config.prefill_weights, config.decode_weights, config.int4_group_size, group=group,
                           expert_parallel=config.expert_parallel, lm_head_weights=config.lm_head_weights)
        tokenizer = None
        if (Path(model_dir) / "tokenizer.json").exists():
            from backend.tokenizer import Tokenizer

            tokenizer = Tokenizer.from_model_dir(Path(model_dir))
        return cls(model, config, tokenizer)

    # -- requests ----------------------------------------------------------------------
    def new_sequence(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                     cache_salt: str | None = None, hold: bool = False) -> Sequence:
        """A validated Sequence (not queued); typed errors for bad parameters or ids."""
        params.validate(self.model.cfg.vocab_size)
        if any(not 0 <= t < self.model.cfg.vocab_size for t in prompt_ids):
            raise InvalidRequest(f"prompt token ids must be in [0, {self.model.cfg.vocab_size})")
        if params.stop and self.tokenizer is None:
            raise InvalidSamplingParams("stop strings need a tokenizer; this model folder has none", field="stop")
        seq = Sequence(request_id or uuid.uuid4().hex, list(prompt_ids), params, self.eos_token_ids, hold_pages=hold,
                       tenant=cache_salt or "")
        if params.grammar is not None:
            seq.grammar = self.grammar_compiler().state(params.grammar)
        if self.scheduler.prefix_cache is not None:
            from prefix_cache.hashing import block_hashes

            seq.block_hashes = block_hashes(seq.prompt_ids, self.config.page_size, cache_salt or "")
        self.scheduler.validate(seq)
        return seq

    def grammar_compiler(self) -> GrammarCompiler:
        """The worker's grammar compiler and cache (built on first use: ~0.3 s for a 49k vocabulary)."""
        if self._grammars is None:
            backend_json = getattr(self.tokenizer, "backend_json", None)
            if backend_json is None:
                raise InvalidSamplingParams("structured output needs a tokenizer; this model folder has none",
                                            field="response_format")
            self._grammars = GrammarCompiler(backend_json(), self.model.cfg.vocab_size, self.eos_token_ids)
        return self._grammars

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    cache_salt: str | None = None, hold: bool = False) -> Sequence:
        """Validate and queue; raises typed errors (nothing is queued then). `cache_salt` (set by the
        gateway from the tenant, never by a client) keys prefix-cache sharing; `hold` keeps the pages
        after the request finishes, until `release_held` (prefill role)."""
        seq = self.new_sequence(prompt_ids, params, request_id, cache_salt, hold)
        self.scheduler.add(seq)
        return seq

    # -- disaggregation (any thread) ------------------------------------------------------
    def reserve(self, seq: Sequence) -> bool:
        """Decode role: take every page `seq` may need before its KV is sent; False when not free now."""
        return self.scheduler.reserve(seq)

    def install_kv(self, seq: Sequence, layer: int, k: torch.Tensor | LatentRows, v: torch.Tensor | None,
                   k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
        """Write the prompt's K/V of one layer ([T, kv_heads, head_dim]; FP8 with exponents, or float;
        an MLA model's `LatentRows` with v None) into `seq`'s reserved pages, after checking that the
        pages are still the ones reserved. Raises the stopping error (EngineStopped) once the engine
        thread has stopped."""
        self.check_transfer_target(seq)
        if isinstance(k, LatentRows):
            if not isinstance(self.cache, LatentKVCache):
                raise InvalidRequest(f"latent KV rows sent for request {seq.request_id} to a pool of K/V pages")
            slots = self.runner.slots(seq.page_ids, 0, k.rows.shape[0])
            if self.kv_exchange is not None:
                self.kv_exchange.install_rows(layer, slots, k)
            else:
                self.cache.write_rows(layer, slots, k)
            return
        if self.kv_exchange is None and k_scale is not None and self.cache.quantised:  # FP8 pages as they are
            self.cache.write_stored(layer, seq.page_ids, k, v, k_scale, v_scale)
            return
        slots = self.runner.slots(seq.page_ids, 0, k.shape[0])
        if self.kv_exchange is not None:
            self.kv_exchange.install(layer, slots, k, v, k_scale, v_scale)
        else:
            self.cache.write_tokens(layer, slots, k, v, k_scale, v_scale)

    def check_transfer_target(self, seq: Sequence, written: bool = False) -> None:
        """Decode role, any thread: raise KVIntegrityError (cause "transfer_target") unless `seq` still
        holds the pages it reserved. `written`: a peer has already written into them (a direct
        transfer, `mooncake_transfer.py`); a page that changed hands then holds those bytes instead
        of its new owner's, so it is marked overwritten and the step check ends whoever owns it now."""
        self.scheduler.check_open()
        if seq.status is not SequenceStatus.RECEIVING:
            raise InvalidRequest(f"request {seq.request_id} holds no reservation")
        found = self.allocator.tags_of(seq.page_ids)
        bad = [(page, want, have) for page, want, have in zip(seq.page_ids, seq.page_tags, found) if want != have]
        if not bad:
            return
        page, want, have = bad[0]
        if written:
            self.integrity.mark_overwritten((p, h) for p, _, h in bad)
        raise KVIntegrityError(
            f"KV transfer for request {seq.request_id} {'landed' if written else 'would land'} in page {page}, "
            f"which changed hands (expected tag {want}, found {have}); "
            f"{'its new owner is ended too' if written else 'not written'}", request_id=seq.request_id,
            page=page, expected_tag=want, found_tag=have, cause="transfer_target")

    def activate(self, seq: Sequence, first_token: int, generator_state: torch.Tensor | None = None) -> None:
        """Decode role: every layer is installed; the first token (sampled by the prefill worker) is
        emitted by the next step, which runs no batch (so it does not wait a decode step), and decoding
        continues from it at the step after."""
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.output_ids = [first_token]
        if generator_state is not None and seq.generator is not None:
            seq.generator.set_state(generator_state)
        self.scheduler.activate(seq)

    def release_reserved(self, seq: Sequence) -> bool:
        """Give back a reservation (see `Scheduler.release_reserved`); False when there was none."""
        return self.scheduler.release_reserved(seq)

    def read_kv(self, seq: Sequence, layer: int) -> tuple[torch.Tensor, torch.Tensor] | tuple[LatentRows, None]:
        """Prefill role: the prompt's K, V [T, kv_heads, head_dim] of a held request (compute dtype);
        for an MLA model its raw latent rows in the pool format (`LatentRows`) and None.

        Any thread. The engine thread may free the held pages meanwhile (`_expire_held`, an abort)
        and hand them to another request, so the pages' tags are checked before the copy and again
        after it: a page that changed hands at any point raises KVIntegrityError (cause "held_read")
        instead of returning another request's KV. On CUDA the copy is queued on the stream before
        the second check, so a new owner's writes, issued after its allocation, land after it."""
        def read(pages: list[int]) -> tuple[torch.Tensor, torch.Tensor] | tuple[LatentRows, None]:
            slots = self.runner.slots(pages, 0, seq.num_prompt_tokens)
            if isinstance(self.cache, LatentKVCache):
                return self.cache.read_rows(layer, slots), None
            return (self.kv_exchange.read(layer, slots) if self.kv_exchange is not None
                    else self.cache.read_tokens(layer, slots))

        return self._read_held(seq, read)

    def read_kv_stored(self, seq: Sequence, layer: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Prefill role: `read_kv` without dequantising: the prompt's K, V [T, kv_heads, head_dim] as this
        engine's FP8 pool stores them (float8_e4m3fn) with their int8 exponents [T, kv_heads], the form FP8
        frames carry. None when its pool holds no FP8 K/V pages of its own (other formats, latent rows, a
        tensor-parallel pool): use `read_kv`. Any thread; the same tag checks."""
        if isinstance(self.cache, LatentKVCache) or not self.cache.quantised or self.kv_exchange is not None:
            return None
        return self._read_held(seq, lambda pages: self.cache.read_stored(layer, pages, seq.num_prompt_tokens))

    def _read_held(self, seq: Sequence, read):
        """`read(pages)` of held `seq`'s pages, between two checks that they are still its own."""
        if seq.status is not SequenceStatus.HELD:
            raise InvalidRequest(f"request {seq.request_id} is not held")
        pages, tags = seq.page_ids, seq.page_tags  # replaced, never mutated, when the pages are freed
        self.check_held_pages(seq, pages, tags)
        out = read(pages)
        self.check_held_pages(seq, pages, tags)
        return out

    def check_held_pages(self, seq: Sequence, pages: list[int], tags: list[int]) -> None:
        """Prefill role, any thread: raise KVIntegrityError (cause "held_read") unless the held
        `seq` still owns `pages` under `tags` (taken before a read of them)."""
        self.scheduler.check_open()
        if len(pages) < self.scheduler.pages_for(seq.num_prompt_tokens) or len(tags) != len(pages):
            raise KVIntegrityError(
                f"the held KV pages of request {seq.request_id} were freed before its KV was sent; not sent",
                request_id=seq.request_id, page=None, expected_tag=None, found_tag=None, cause="held_read")
        for page, want, have in zip(pages, tags, self.allocator.tags_of(pages)):
            if want != have:
                log.warning("kv integrity abort: held request %s page %s expected %s found %s", seq.request_id,
                            page, want, have)
                raise KVIntegrityError(
                    f"the held KV page {page} of request {seq.request_id} changed hands while its KV was read "
                    f"(expected tag {want}, found {have}); not sent", request_id=seq.request_id, page=page,
                    expected_tag=want, found_tag=have, cause="held_read")

    def release_held(self, request_id: str) -> bool:
        return self.scheduler.release_held(request_id)

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

    def has_work(self) -> bool:
        """Whether a step would do anything. Once this engine's group has failed: True until a step has
        ended every request with the failure, then raises it (`GroupFailure`)."""
        if self.group is not None and self.group.failure is not None:
            if self._group_ended:
                raise self.group.failure
            return True
        return self.scheduler.has_work()

    # -- the loop ----------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """schedule() -> run() -> postprocess(), then publish what other threads read."""
        if self.group is not None and self.group.failure is not None:
            return self._end_group(self.group.failure)
        outputs = self._start_activated()
        if outputs:  # transferred requests' first tokens go out now, not after this step's batch has run
            self.publish()
            return outputs
        self._expire_held()
        batch = self.scheduler.schedule()
        outputs += self._cancelled(batch.aborted)
        if not batch.empty:
            outputs += self._run_batch(batch)
        self.publish()
        return outputs

    def _end_group(self, err: EdgeServeError) -> list[StepOutput]:
        """The group is gone: end every request with `err` and refuse new work (the scheduler is closed)."""
        self._group_ended = True
        now = time.perf_counter()
        ended = self.scheduler.close(err)
        self._stop_checkers.clear()
        self.stats["failed"] += len(ended)
        self.publish(force=True)
        return [StepOutput(s, None, now, True, err) for s in ended]

    def _cancelled(self, aborted: list[Sequence]) -> list[StepOutput]:
        now = time.perf_counter()
        for s in aborted:
            self._stop_checkers.pop(s.request_id, None)
            self.stats["cancelled"] += 1
        return [StepOutput(s, None, now, True) for s in aborted]

    def _run_batch(self, batch: ScheduledBatch) -> list[StepOutput]:
        """Check, run and sample one batch. A failure anywhere in it ends the batch's requests with the
        error (pages returned) and is counted in `failed_steps_in_row`; the engine goes on."""
        outputs: list[StepOutput] = []
        try:
            if self.config.integrity_check:
                t0 = time.perf_counter()
                batch, failed = self._check_integrity(batch)
                self.stats["integrity_check_s"] += time.perf_counter() - t0
                outputs += failed
            if not batch.empty:
                with self._threads_for(batch):
                    logits = self.runner.run(batch)
                    self.stats["steps"] += 1
                    outputs += self.postprocess(batch, logits)
        except Exception as exc:  # fail this step's requests, keep the engine serving
            log.exception("engine step failed")
            self.failed_steps_in_row += 1
            err = exc if isinstance(exc, EdgeServeError) else EdgeServeError(f"engine step failed: {exc}")
            return outputs + self._fail(batch, err)
        self.failed_steps_in_row = 0
        return outputs

    def _threads_for(self, batch: ScheduledBatch) -> contextlib.AbstractContextManager[None]:
        """torch at one thread for a step whose every linear runs the C GEMV (its helpers take the other cores;
        `kernels/cpu_threads.py` says why and what it measured), torch's pool as it is otherwise."""
        if self.runner.gemv_decode and batch.num_tokens <= self.runner.gemv_rows:
            return torch_single_threaded()
        return contextlib.nullcontext()

    def _setup_graphs(self) -> None:
        """Decode graphs for this engine's steps (`EngineConfig.cuda_graphs`), holding one page of the pool as
        their padding rows' page for good; logged and left off where the model does not take them."""
        why = graphs_supported(self.model)
        if why is not None:
            log.info("decode graphs off: %s", why)
            return
        pad_page = self.allocator.allocate(1)[0]
        pages = -(-self.max_model_len // self.config.page_size)
        self.runner.graphs = DecodeGraphs(self.model, self.cache, pad_page, self.config.max_num_seqs, pages,
                                          capture=self.model.embed.device.type == "cuda")

    def _start_activated(self) -> list[StepOutput]:
        """Emit the first token of requests whose KV arrived; finish those it already ends."""
        outputs = []
        now = time.perf_counter()
        for s in self.scheduler.take_activated():
            s.first_token_time = now
            outputs.append(self._emit(s, s.output_ids[-1], now))
        return outputs

    def _expire_held(self) -> None:
        """Free held pages nobody collected within `held_timeout_s` (the transfer's reader died or stalled;
        a reader still copying them out gets KVIntegrityError from `read_kv`)."""
        if not self.scheduler.held:
            return
        for rid in self.scheduler.held_since(time.perf_counter() - self.config.held_timeout_s):
            if self.scheduler.release_held(rid):
                self.stats["held_expired"] += 1
                log.warning("freed the held pages of %s: its KV was not collected in time", rid)

    def _check_integrity(self, batch: ScheduledBatch) -> tuple[ScheduledBatch, list[StepOutput]]:
        """One batched page-tag check over the whole step, before the model runs (`backend/step_integrity.py`).
        A sequence whose pages changed hands is ended with KVIntegrityError (its still-owned pages returned)
        and dropped from the batch: it emits nothing read from another request's pages. The rest of the
        batch runs untouched."""
        failures = self.integrity.failures([*batch.decode, *(s for s, _ in batch.prefill)])
        self.stats["integrity_checks"] += 1
        if not failures:
            return batch, []
        now = time.perf_counter()
        failed: list[StepOutput] = []
        for s, err in failures:
            log.warning("kv integrity abort: request %s page %s expected %s found %s", s.request_id,
                        err.details["page"], err.details["expected_tag"], err.details["found_tag"])
            self.scheduler.finish(s, "error")
            self._stop_checkers.pop(s.request_id, None)
            self.stats["integrity_aborts_by_cause"][err.details["cause"]] += 1
            failed.append(StepOutput(s, None, now, True, err))
        bad = {f.seq.request_id for f in failures}
        kept = ScheduledBatch([s for s in batch.decode if s.request_id not in bad],
                              [(s, n) for s, n in batch.prefill if s.request_id not in bad], batch.aborted)
        return kept, failed

    def _fail(self, batch: ScheduledBatch, err: EdgeServeError) -> list[StepOutput]:
        """End every sequence of a failed step so their pages return; report the error for each
        (also to one that finished in the step before it failed: its final event was not sent)."""
        now = time.perf_counter()
        failed = []
        for s in [*batch.decode, *(s for s, _ in batch.prefill)]:
            if s in self.scheduler.running:
                self.scheduler.finish(s, "error")
            else:  # finished in the step before it failed; if into `held`, nobody will read that KV
                self.scheduler.release_held(s.request_id)
            self._stop_checkers.pop(s.request_id, None)
            failed.append(StepOutput(s, None, now, True, err))
        self.stats["failed"] += len(failed)
        return failed

    def postprocess(self, batch: ScheduledBatch, logits: torch.Tensor) -> list[StepOutput]:
        """Advance counters, score prompt positions, sample, append tokens, finish sequences that stop."""
        scored = [(s, s.scored_positions(s.num_computed_tokens, n)) for s, n in batch.prefill]
        sampled_seqs = list(batch.decode)
        for s in batch.decode:
            s.num_computed_tokens += 1
        for s, n in batch.prefill:
            s.num_computed_tokens += n
            self.stats["prompt_tokens"] += n
            self.scheduler.prompt_progress(s, s.num_computed_tokens - n)
            if not s.is_prefilling:
                sampled_seqs.append(s)
                self.scheduler.prompt_computed(s)
        if logits.shape[0] == 0:  # only prompt chunks that neither complete nor score
            return []
        if logits.is_cuda:  # sampling runs on the CPU (per-request CPU generators); [B, vocab] is small
            logits = logits.cpu()
        if logits.shape[0] > len(sampled_seqs):  # prompt positions scored after the sampled rows
            self._score_prompts(scored, logits[len(sampled_seqs):])
        if not sampled_seqs:
            return []
        logits = logits[: len(sampled_seqs)]
        params = [s.params for s in sampled_seqs]
        tokens = sample(logits, params, [s.generator for s in sampled_seqs],
                        [s.prompt_ids for s in sampled_seqs], [s.output_ids for s in sampled_seqs],
                        [s.grammar.mask if s.grammar is not None else None for s in sampled_seqs])
        now = time.perf_counter()
        outputs = []
        for row, (s, tok) in enumerate(zip(sampled_seqs, tokens)):
            prompt_lp, s.prompt_logprobs = s.prompt_logprobs, None  # handed over once
            if prompt_lp is None and s.params.prompt_logprobs is not None and s.num_prompt_tokens == 1:
                prompt_lp = Logprobs([])  # nothing to score after the first token
            if s.params.max_tokens == 0:  # only the prompt was asked for
                self.scheduler.finish(s, "length")
                self._stop_checkers.pop(s.request_id, None)
                self.stats["finished"] += 1
                outputs.append(StepOutput(s, None, now, True, prompt_logprobs=prompt_lp))
                continue
            s.output_ids.append(tok)
            if s.first_token_time is None:
                s.first_token_time = now
            err = self._advance_grammar(s, tok) if s.grammar is not None else None
            if err is not None:
                outputs.append(StepOutput(s, None, now, True, err))
                continue
            lp = None
            if s.params.logprobs is not None:
                lp = logprobs_of(logits[row: row + 1], torch.tensor([tok]), s.params.logprobs)
            outputs.append(self._emit(s, tok, now)._replace(logprobs=lp, prompt_logprobs=prompt_lp))
        return outputs

    def _advance_grammar(self, s: Sequence, tok: int) -> EdgeServeError | None:
        """Feed `tok` to `s`'s grammar and compute its next mask now, before the next forward (EOS, which
        ends the request, is not fed). On a refusal `s` is ended and the error returned."""
        if tok in s.eos_token_ids:
            return None
        t0 = time.perf_counter()
        try:
            s.grammar.advance(tok)
        except EdgeServeError as exc:
            self.scheduler.finish(s, "error")
            self._stop_checkers.pop(s.request_id, None)
            self.stats["failed"] += 1
            return exc
        finally:
            self.stats["grammar_advances"] += 1
            self.stats["grammar_advance_s"] += time.perf_counter() - t0
        return None

    def _score_prompts(self, scored: list[tuple[Sequence, range]], logits: torch.Tensor) -> None:
        """Append to each scoring sequence the logprobs of the prompt tokens its rows predict."""
        row = 0
        for s, positions in scored:
            if not positions:
                continue
            targets = torch.tensor(s.prompt_ids[positions.start + 1: positions.stop + 1])
            lp = logprobs_of(logits[row: row + len(positions)], targets, s.params.prompt_logprobs or 0)
            row += len(positions)
            if s.prompt_logprobs is None:
                s.prompt_logprobs = lp
            else:
                s.prompt_logprobs.extend(lp)

    def _emit(self, s: Sequence, tok: int, now: float) -> StepOutput:
        """Count a new token of `s` and finish `s` if the token stops it."""
        self.stats["generated_tokens"] += 1
        reason = self._check_stop(s, tok)
        if reason is not None:
            self.scheduler.finish(s, reason)
            self._stop_checkers.pop(s.request_id, None)
            self.stats["finished"] += 1
        return StepOutput(s, tok, now, reason is not None)

    def _check_stop(self, s: Sequence, tok: int) -> str | None:
        p = s.params
        if not p.ignore_eos and tok in s.eos_token_ids:
            s.stop_reason = tok
            return "stop"
        if tok in p.stop_token_ids:
            s.stop_reason = tok
            return "stop"
        if s.grammar is not None and s.grammar.done:  # the document is complete: only EOS could follow
            return "stop"
        if p.stop:
            checker = self._stop_checkers.get(s.request_id)
            if checker is None:
                checker = self._stop_checkers[s.request_id] = StopChecker(self.tokenizer, p.stop)
            matched = checker.push(tok)
            if matched is not None:
                s.stop_reason = matched
                return "stop"
        if len(s.output_ids) >= p.max_tokens or s.num_tokens >= self.max_model_len:
            return "length"
        return None

    # -- offline scoring -----------------------------------------------------------------
    @torch.inference_mode()
    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Log-probability of each token given those before it, [len - 1] float32.

        Runs the text through the same paged KV path as serving (chunked prefill,
        every key read back from the pool in the worker's KV format), so it measures
        what that format does to quality. Offline use: call it from the engine thread
        or with the engine idle, never concurrently with `step`.
        """
        return self.score_tokens(token_ids).logprobs

    @torch.inference_mode()
    def score_tokens(self, token_ids: list[int], dist: bool = False) -> TokenScores:
        """`score`'s log-probabilities plus whether each token was the model's top-1 prediction (and with
        `dist` the whole next-token distribution at every position, e.g. for a KL between two formats)."""
        seq = Sequence("score-" + uuid.uuid4().hex, list(token_ids), SamplingParams(max_tokens=1))
        n = len(token_ids)
        if not 2 <= n <= self.max_model_len:
            raise InvalidRequest(f"score needs 2..{self.max_model_len} tokens, got {n}")
        seq.page_ids = self.allocator.allocate(self.scheduler.pages_for(n))
        logprobs, top1, dists = [], [], []
        try:
            chunk = self.config.prefill_chunk_size
            for start in range(0, n - 1, chunk):
                take = min(chunk, n - 1 - start)
                batch = ScheduledBatch([], [(seq, take)], [])
                input_ids, meta = self.runner.prepare(batch)
                meta.logits_rows = torch.arange(take, device=self.runner.device)
                logits = self.model.forward(input_ids, meta, self.cache).cpu()
                targets = torch.tensor(token_ids[start + 1: start + 1 + take])
                rows = logits.log_softmax(-1)
                logprobs.append(rows.gather(1, targets.unsqueeze(1)).squeeze(1))
                if dist:
                    dists.append(rows)
                top1.append(logits.argmax(-1) == targets)
                seq.num_computed_tokens += take
        finally:
            self.allocator.release(seq.page_ids)
            seq.page_ids = []
        return TokenScores(torch.cat(logprobs), torch.cat(top1), torch.cat(dists) if dist else None)

    # -- introspection -----------------------------------------------------------------
    def snapshot(self) -> dict[str, object]:
        """Load and pool occupancy, for health/stats and routing; safe from any thread.

        Counts that are one `len` (running, waiting, held, free pages) are read now; the rest
        (queued prompt tokens, evictable pages, prefix-cache figures, counters) are the values the
        engine thread last published (see the module docstring), never read off its structures here."""
        free = self.allocator.num_free
        return {
            **self._published,
            "running": len(self.scheduler.running),
            "waiting": self.scheduler.num_waiting,
            "held": len(self.scheduler.held),
            "pages_free": free,
            "pages_used": self.allocator.num_pages - free,
        }

    def publish(self, force: bool = False) -> None:
        """Engine thread (or with it stopped): recompute what `snapshot()` returns besides the live counts.
        Skipped while busy if the last publication is younger than `PUBLISH_INTERVAL_S`, unless `force`."""
        now = time.monotonic()
        if not force and now - self._published_at < PUBLISH_INTERVAL_S and self.has_work():
            return
        cache = self.scheduler.prefix_cache
        by_cause = dict(self.stats["integrity_aborts_by_cause"])
        self._published = {  # a new dict each time: a reader holds the old one, never a half-written one
            "pages_total": self.allocator.num_pages,
            "page_size": self.cache.page_size,
            "kv_format": self.cache.format_name,
            "kv_bytes_per_token": self.cache.bytes_per_token,
            "max_model_len": self.max_model_len,
            "queued_prefill_tokens": self.scheduler.queued_prefill_tokens(),
            "pages_evictable": cache.evictable() if cache is not None else 0,
            "prefix_cache": self._prefix_cache_stats(),
            **self.stats,
            "integrity_aborts_by_cause": by_cause,
            "integrity_aborts": sum(by_cause.values()),
            "kv_events_dropped": self.kv_events_dropped,
        }
        self._published_at = now

    def _record_kv_event(self, event: KVEvent) -> None:
        """The prefix cache's event sink: append, counting the oldest event a full list drops."""
        if len(self.kv_events) == self.kv_events.maxlen:
            self.kv_events_dropped += 1  # a publisher popping meanwhile makes this an overcount: stale, safe
        self.kv_events.append(event)

    def _prefix_cache_stats(self) -> dict[str, object] | None:
        cache = self.scheduler.prefix_cache
        if cache is None:
            return None
        q = self.scheduler.cache_stats
        return {"blocks": len(cache), **cache.stats, **q,
                "hit_rate": q["hit_tokens"] / q["query_tokens"] if q["query_tokens"] else 0.0}
