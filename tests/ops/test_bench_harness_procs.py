"""`ops.bench.harness.procs.wait_registered`: the benchmarks' wait for their workers' registry records."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from backend.errors import BackendUnavailable
from backend.registration import record_key
from ops.bench.harness.procs import wait_registered


def test_wait_registered_names_the_missing_workers_and_shows_their_logs(redis_url: str, tmp_path: Path) -> None:
    client = redis.Redis.from_url(redis_url)
    client.set(record_key("m", "w1"), b"{}")
    logs = {w: tmp_path / f"{w}.log" for w in ("w1", "w2")}
    logs["w1"].write_text("w1 started\n")
    logs["w2"].write_text("w2: Redis (worker registry) unreachable\n")
    with pytest.raises(BackendUnavailable) as err:
        wait_registered(redis_url, "m", ["w1", "w2"], timeout_s=0.5, logs=logs)
    message = err.value.message
    assert "workers ['w2'] of ['w1', 'w2'] did not register" in message
    assert "w2: Redis (worker registry) unreachable" in message and "w1 started" not in message
    client.set(record_key("m", "w2"), b"{}")
    wait_registered(redis_url, "m", ["w1", "w2"], timeout_s=0.5, logs=logs)  # both there: returns
    client.close()
