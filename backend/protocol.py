"""Wire messages of the worker API (msgspec structs; NDJSON frames on HTTP).

A generate call sends `GenerateRequest` and receives a stream of `Event`s:
zero or more `TokenEvent`s, then exactly one `FinishEvent` or `ErrorEvent`.
A request that asks for log-probabilities gets them on its `TokenEvent`s (`logprobs`
for the new tokens; `prompt_logprobs` once, on the first event, which has no token
ids when `max_tokens` is 0); the fields are omitted otherwise, so the frames of other
requests are unchanged.
A request with `stream=False` (its caller reads the answer whole) may get several
events in one write, and the token events of one write as one `TokenEvent` (ids, times
and logprobs concatenated; `event_frames.py`): a reader counts `len(token_ids)`, never events.
A cancel sends `CancelRequest` with the `cancel_key` its request was started with.
"""

from __future__ import annotations

import msgspec

from backend.sampling_params import SamplingParams

__all__ = ["GenerateRequest", "CancelRequest", "Logprobs", "TokenEvent", "FinishEvent", "ErrorEvent", "Event", "encoder",
           "event_decoder"]


class GenerateRequest(msgspec.Struct, forbid_unknown_fields=True):
    prompt_ids: list[int]
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    request_id: str | None = None
    model: str | None = None  # checked against the served model when given
    # the tenant, set by the gateway (never a client): the prefix cache's namespace and admission's share key
    cache_salt: str | None = None
    prefill_url: str | None = None  # decode role: the prefill worker the router paired it with
    cancel_key: str | None = None  # secret of the caller: /v1/cancel of this request must present it
    stream: bool = True  # False: the caller reads the answer whole; events may be written together
    # (at most `event_frames.FLUSH_S` apart) instead of one write per token


class CancelRequest(msgspec.Struct, forbid_unknown_fields=True):
    """Body of `POST /v1/cancel/{request_id}`: the key the request was started with."""

    cancel_key: str


class Logprobs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Log-probabilities (natural log, the model's raw distribution) of consecutive tokens:
    `token[i]` of the i-th token, and its `top_ids[i]` / `top_logprobs[i]` most likely
    alternatives, most likely first (empty lists when none were asked for)."""

    token: list[float]
    top_ids: list[list[int]] = []
    top_logprobs: list[list[float]] = []

    def extend(self, other: Logprobs) -> None:
        """Append `other`'s positions (in place)."""
        self.token += other.token
        self.top_ids += other.top_ids
        self.top_logprobs += other.top_logprobs


class TokenEvent(msgspec.Struct, tag="token", tag_field="event", omit_defaults=True, gc=False):
    """New token ids and, for each, seconds since the request arrived at the worker; their
    log-probabilities when asked for, and (once) those of prompt tokens 1..n-1."""

    token_ids: list[int]
    times: list[float]
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None


class FinishEvent(msgspec.Struct, tag="finish", tag_field="event", gc=False):
    finish_reason: str  # "stop" | "length" | "cancelled"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (none until it lands)
    stop_reason: str | int | None = None  # the matched stop string or stop token id
    ttft_s: float | None = None
    total_s: float = 0.0


class ErrorEvent(msgspec.Struct, tag="error", tag_field="event", gc=False):
    code: int
    type: str
    message: str
    completion_tokens: int = 0


Event = TokenEvent | FinishEvent | ErrorEvent

encoder = msgspec.json.Encoder()
event_decoder: msgspec.json.Decoder[Event] = msgspec.json.Decoder(Event)
