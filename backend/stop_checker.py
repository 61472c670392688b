"""Stop-string detection on the incrementally decoded output text.

Only the text added since the last token, plus enough of the tail to catch a
stop string that straddles tokens, is searched, so the cost per token is
O(longest stop string) rather than O(output length).
"""

from __future__ import annotations

from typing import Any

__all__ = ["StopChecker"]


class StopChecker:
    def __init__(self, tokenizer: Any, stops: list[str]) -> None:
        from backend.tokenizer import IncrementalDetokenizer

        self._detok = IncrementalDetokenizer(tokenizer)
        self._stops = stops
        self._tail = ""
        self._keep = max(len(s) for s in stops) - 1

    def push(self, token_id: int) -> str | None:
        """Feed one output token; return the stop string it completed, if any."""
        new = self._detok.push(token_id)
        if not new:
            return None
        window = self._tail + new
        for stop in self._stops:
            if stop in window:
                return stop
        self._tail = window[-self._keep:] if self._keep else ""
        return None
