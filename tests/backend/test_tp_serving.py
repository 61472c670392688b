"""A tensor-parallel worker serving over HTTP: rank 0 in this process (or `edgeserve serve
--tensor-parallel 2` as a subprocess), its follower spawned. A follower killed mid-stream ends
the in-flight request with a typed error at once, the worker leaves the registry and /health
turns 503; one that dies while the worker is idle does the same; SIGTERM stops the whole group."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
import redis

from backend.async_engine import AsyncEngine
from backend.distributed.group import GroupSpec, LeaderGroup, start_group
from backend.engine import EngineConfig, LLMEngine
from backend.protocol import ErrorEvent, FinishEvent, GenerateRequest, TokenEvent, event_decoder
from backend.registration import Heartbeat, WorkerRecord, members_key, record_key
from backend.sampling_params import SamplingParams
from backend.worker import create_worker_app
from tests.backend.servers import free_port, serve_in_thread
from tests.backend.tiny_models import write_tiny_model

PROMPT = [(5 * i) % 300 + 3 for i in range(20)]
GREEDY = dict(temperature=0.0, ignore_eos=True)
CONFIG = dict(dtype="float32", kv_format="fp32", kv_cache_bytes=2 * 2**20, page_size=16, gemm_buckets=(),
              num_threads=1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tp-serve") / "m", "llama", seed=11)


@contextlib.contextmanager
def tp_worker(model_dir: Path, redis_url: str) -> Iterator[tuple[str, LeaderGroup, redis.Redis]]:
    """A registered unified worker whose engine is rank 0 of a group of 2."""
    config = EngineConfig(**CONFIG, tensor_parallel=2)
    group = start_group(GroupSpec(2, str(model_dir), config, timeout_s=30))
    r = redis.Redis.from_url(redis_url)
    try:
        eng = LLMEngine.from_pretrained(model_dir, config, group.coll)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        record = WorkerRecord(id="tp", url=url, role="unified", model="tiny", region="local", page_size=16,
                              pages_total=eng.allocator.num_pages, pages_free=eng.allocator.num_pages, running=0,
                              waiting=0, queued_prefill_tokens=0, pages_evictable=0)
        beat = Heartbeat(redis_url, lambda: record, interval_s=0.1, ttl_s=60)
        with serve_in_thread(create_worker_app(AsyncEngine(eng), "tiny", registration=beat.run), port=port):
            wait_until(lambda: r.exists(record_key("tiny", "tp")), "the worker never registered")
            yield url, group, r
    finally:
        group.shutdown()
        r.close()


def wait_until(cond, message: str, timeout_s: float = 5.0) -> float:
    """Poll `cond` until true; returns the seconds it took."""
    start = time.monotonic()
    while not cond():
        assert time.monotonic() - start < timeout_s, message
        time.sleep(0.05)
    return time.monotonic() - start


def assert_left(url: str, r: redis.Redis) -> None:
    wait_until(lambda: not r.exists(record_key("tiny", "tp")) and not r.sismember(members_key("tiny"), "tp"),
               "the worker whose group died is still registered")
    health = httpx.get(f"{url}/health")
    assert health.status_code == 503 and health.json()["status"] == "failed"
    resp = httpx.post(f"{url}/v1/generate", content=msgspec.json.encode(GenerateRequest(PROMPT)))
    assert resp.status_code == 503 and resp.json()["error"]["code"] == 5004  # EngineStopped


def test_follower_killed_mid_stream_ends_the_request_with_a_typed_error(model_dir: Path, redis_url: str) -> None:
    with tp_worker(model_dir, redis_url) as (url, group, r):
        body = msgspec.json.encode(GenerateRequest(PROMPT, SamplingParams(max_tokens=400, **GREEDY)))
        events = []
        killed_at = None
        with httpx.stream("POST", f"{url}/v1/generate", content=body, timeout=30) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                events.append(event_decoder.decode(line))
                if killed_at is None and isinstance(events[-1], TokenEvent):
                    os.kill(group.pids[1], signal.SIGKILL)
                    killed_at = time.monotonic()
        assert time.monotonic() - killed_at < 5  # no hang
        last = events[-1]
        assert isinstance(last, ErrorEvent) and last.code == 5004 and last.type == "GroupFailure", last
        assert not any(isinstance(ev, FinishEvent) for ev in events)
        tokens = sum(len(ev.token_ids) for ev in events if isinstance(ev, TokenEvent))
        assert 1 <= tokens < 400 and last.completion_tokens == tokens
        assert_left(url, r)


def test_follower_dying_while_idle_ends_the_group(model_dir: Path, redis_url: str) -> None:
    with tp_worker(model_dir, redis_url) as (url, group, r):
        assert httpx.get(f"{url}/health").status_code == 200
        os.kill(group.pids[1], signal.SIGKILL)
        assert_left(url, r)


@pytest.mark.parametrize("launcher", ["spawn", "torchrun"])
def test_serve_cli_tensor_parallel_answers_and_stops_on_sigterm(model_dir: Path, launcher: str) -> None:
    """`edgeserve serve --tensor-parallel 2`, its follower spawned by the worker or both ranks launched by
    torchrun: the same greedy tokens as one process; SIGTERM ends every rank."""
    ref = LLMEngine.from_pretrained(model_dir, EngineConfig(**CONFIG))
    seq = ref.add_request(PROMPT, SamplingParams(max_tokens=8, **GREEDY))
    while ref.has_work():
        ref.step()
    port = free_port()
    serve = ["serve", "--model", str(model_dir), "--port", str(port), "--tensor-parallel", "2", "--threads", "1",
             "--kv-cache-bytes", "2M", "--gemm-buckets", "none"]
    launch = [sys.executable, "-m", "ops.cli"] if launcher == "spawn" else \
        [str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", "2", "--master-port", str(free_port()),
         "-m", "ops.cli"]
    proc = subprocess.Popen([*launch, *serve], cwd=Path(__file__).resolve().parents[2], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        def up() -> bool:
            assert proc.poll() is None, proc.stdout.read()
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(f"{url}/health", timeout=1).status_code == 200
            return False

        wait_until(up, "the tensor-parallel worker did not start", timeout_s=90)
        resp = httpx.post(f"{url}/v1/generate", timeout=30, content=msgspec.json.encode(
            GenerateRequest(PROMPT, SamplingParams(max_tokens=8, **GREEDY))))
        events = [event_decoder.decode(line) for line in resp.text.splitlines()]
        assert [t for ev in events if isinstance(ev, TokenEvent) for t in ev.token_ids] == seq.output_ids
        stats = httpx.get(f"{url}/stats").json()["tensor_parallel"]
        assert stats["world_size"] == 2 and stats["collectives"]["calls"]["all_reduce"] > 0
        assert len(stats["rank_weights"]) == 2
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        if launcher == "spawn":
            assert code == 0
            wait_until(lambda: not _alive(int(stats["follower_pids"]["1"])), "the follower outlived rank 0")
        wait_until(lambda: not _session_alive(proc.pid), "a rank outlived the group", timeout_s=15)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _session_alive(sid: int) -> bool:
    """Whether any live (non-zombie) process is left in session `sid` (the launched command's)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[-1].split()
            if int(fields[3]) == sid and fields[0] != "Z":  # fields: state ppid pgrp session ...
                return True
    return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):  # a zombie of a finished child counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    return True
