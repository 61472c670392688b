"""`ops.graceful.serve` freezes the heap built so far before it listens (`backend/heap.py`)."""

from __future__ import annotations

import gc

from starlette.applications import Starlette

from backend.drain import Drain
from ops import graceful


def test_serve_freezes_everything_built_before_it_listens(monkeypatch) -> None:
    gc.unfreeze()
    app = Starlette()
    app.state.drain = Drain()
    built = [{"k": i} for i in range(2000)]  # what an app builds at start-up: long-lived containers
    seen = {}

    def run(self) -> None:  # instead of listening: what the heap looks like when the server would start
        seen["frozen"] = gc.get_freeze_count()
        ids = {id(b) for b in built[:50]}
        seen["still_tracked"] = sum(1 for o in gc.get_objects() if id(o) in ids)

    monkeypatch.setattr(graceful.DrainingServer, "run", run)
    try:
        graceful.serve(app, "127.0.0.1", 0, drain_timeout_s=1.0, render=lambda *a: None)
    finally:
        gc.unfreeze()
    assert seen["frozen"] >= len(built) and seen["still_tracked"] == 0
