"""Start-up objects out of the cyclic garbage collector's sight, so a full collection while serving is short.

CPython's cyclic collector runs a full (generation 2) collection now and then, and it holds the GIL for as long
as it walks every tracked container. A loaded worker tracks ~190,000 of them (torch's and transformers' modules,
the tokenizer, the model's modules and the engine's tables), and a full collection there took 80-155 ms (one
process holding SmolLM2's engine, Python 3.11, a 2-core Zen 4 VM; ~100 ms in `bench integrity`'s process with
three engines). While it runs no step advances, so every request in the batch gets that long a gap between two
tokens: a TPOT p99 cost (a worker serving ~7 requests/s made one such collection in 4 minutes, 125 ms), and the
heavy tail `bench integrity` kept finding in paired steps.

`gc.freeze()` moves every tracked object into the permanent generation, which collections skip. Done once
everything long-lived is built (after a `gc.collect()`, so garbage made while loading is freed first, not frozen),
the objects a collection walks are only those made while serving. Frozen objects are still freed by reference
counting; only a reference cycle among them, dropped later, would stay unreclaimed, and start-up state is not
dropped while a server runs. At exit they are unfrozen again (`atexit`), so the interpreter's last collections
free them as usual: otherwise extension modules that count their live objects at shutdown (triton's nanobind
bindings) print hundreds of lines of "leaked" warnings.
"""

from __future__ import annotations

import atexit
import gc

__all__ = ["freeze_heap"]

atexit.register(gc.unfreeze)  # at exit, whether or not anything was frozen (harmless if not)


def freeze_heap() -> int:
    """Collect, then freeze everything still alive (see the module docstring); the number of frozen objects.
    Calling it again freezes what was made since, after collecting only that (the rest is frozen already)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
