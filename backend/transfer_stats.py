"""Counters of KV transfers (bytes, seconds, tokens, failures), for `/stats` and the benchmark."""

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

    def record(self, num_bytes: int, seconds: float, ok: bool, tokens: int = 0) -> None:
        with self._lock:
            self.transfers += 1
            self.failed += 0 if ok else 1
            self.bytes += num_bytes
            self.tokens += int(tokens or 0)
            self.seconds += seconds

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {"transfers": self.transfers, "failed": self.failed, "bytes": self.bytes, "tokens": self.tokens,
                    "seconds": round(self.seconds, 6),
                    "bytes_per_token": self.bytes / self.tokens if self.tokens else 0.0}
