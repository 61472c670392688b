"""One request's state inside the engine (plain fields, each stored once)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from backend.protocol import Logprobs
from backend.sampling_params import SamplingParams

if TYPE_CHECKING:
    from backend.grammar import GrammarState

__all__ = ["SequenceStatus", "Sequence"]


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no pages
    RECEIVING = "receiving"  # holds reserved pages; its KV is arriving from a prefill worker
    RUNNING = "running"  # holds its pages; prefilling until num_computed_tokens == num_prompt_tokens
    HELD = "held"  # finished on a prefill worker; pages kept until its KV has been sent
    FINISHED = "finished"  # pages returned


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    status: SequenceStatus = SequenceStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    page_ids: list[int] = field(default_factory=list)  # page table, in token order
    page_tags: list[int] = field(default_factory=list)  # generation tag expected for each page
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (not computed)
    cached_on_arrival: int = 0  # prompt tokens the prefix cache held when queued (a routing hint; admission counts)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of the prompt's full blocks
    hold_pages: bool = False  # keep the pages after finishing (prefill role: they are sent, then released)
    tenant: str = ""  # who sent it (the gateway's tenant id, also its `cache_salt`): admission is shared by tenant
    direct_deadline: float | None = None  # decode role: a peer may write into the reserved pages until then
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    stop_reason: str | int | None = None  # matched stop string or stop token id
    abort_requested: bool = False
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    generator: torch.Generator | None = None
    prompt_logprobs: Logprobs | None = None  # prompt tokens 1.. scored so far (params.prompt_logprobs set)
    grammar: GrammarState | None = None  # matcher and next-token mask (params.grammar set)

    def __post_init__(self) -> None:
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def max_total_tokens(self) -> int:
        """Tokens this request may ever hold in the cache (its page reservation)."""
        return self.num_prompt_tokens + self.params.max_tokens

    def scored_positions(self, start: int, num_tokens: int) -> range:
        """Positions of a prefill chunk [start, start + num_tokens) whose logits score the next prompt token:
        none unless the request asks for prompt logprobs; never the last prompt position (it samples)."""
        if self.params.prompt_logprobs is None:
            return range(0)
        return range(start, min(start + num_tokens, self.num_prompt_tokens - 1))

    def token_at(self, index: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[index] if index < n else self.output_ids[index - n]
