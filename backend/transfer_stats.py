"""Counters of KV transfers (bytes, seconds, tokens, failures), for `/stats` and the benchmark.

`seconds`: a transfer's whole time (decode side: request sent -> last layer in, so the
prefill's queueing and compute included). `layer_seconds`: only the layers' movement
(decode side: KVBegin -> KVEnd received; prefill side: first layer read -> last frame
out), the figure that compares transports. `direct`: transfers written straight into
the decode worker's pages (`mooncake_transfer.py`)."""

from __future__ import annotations

import threading

__all__ = ["TransferStats"]


class TransferStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.transfers = 0
        self.failed = 0
        self.bytes = 0
        self.tokens = 0
        self.seconds = 0.0
        self.layer_seconds = 0.0
        self.direct = 0

    def record(self, num_bytes: int, seconds: float, ok: bool, tokens: int = 0, layer_seconds: float = 0.0,
               direct: bool = False) -> None:
        with self._lock:
            self.layer_seconds += layer_seconds
            self.direct += int(direct and ok)
            self.transfers += 1
            self.failed += 0 if ok else 1
            self.bytes += num_bytes
            self.tokens += int(tokens or 0)
            self.seconds += seconds

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {"transfers": self.transfers, "failed": self.failed, "bytes": self.bytes, "tokens": self.tokens,
                    "seconds": round(self.seconds, 6), "layer_seconds": round(self.layer_seconds, 6),
                    "direct": self.direct,
                    "bytes_per_token": self.bytes / self.tokens if self.tokens else 0.0}
