"""Progress lines on stderr, flushed at once: a benchmark's table and JSON path go to stdout, so
`edgeserve bench X > table.txt` keeps only the results while the run still shows where it is."""

from __future__ import annotations

import sys

__all__ = ["log"]


def log(msg: str) -> None:
    """Print one progress line on stderr."""
    print(msg, file=sys.stderr, flush=True)
