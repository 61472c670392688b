"""`edgeserve serve --kv-store` as users run it: two real worker processes on one mooncake_master and
one Redis. A prompt computed by the first is served by the second from the store, and the store-tier
KV events reach the routers' index. Settings that cannot work are refused before the model loads."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
import redis

from backend.protocol import GenerateRequest
from backend.registration import WorkerRecord, record_key
from backend.sampling_params import SamplingParams
from ops.cluster import MooncakeMaster
from ops.redis_server import free_ports
from prefix_cache.hashing import block_hashes
from prefix_cache.kv_events import store_block_key
from tests.backend.tiny_models import write_tiny_model
from tests.ops.test_drain import AUTH, ENV, start, stop, wait_up


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "m", "llama", seed=3, max_position_embeddings=1024)


def serve_args(model_dir: Path, port: int, redis_url: str, master: str) -> list[str]:
    return ["serve", "--model", str(model_dir), "--served-name", "tiny", "--port", str(port), "--redis-url", redis_url,
            "--kv-cache-bytes", "4M", "--max-model-len", "1024", "--threads", "1", "--gemm-buckets", "none",
            "--prefix-caching", "--kv-store", master, "--kv-store-segment", "32M", "--kv-store-timeout", "2"]


@pytest.fixture
def two_workers(model_dir: Path, redis_url: str, mooncake_master: MooncakeMaster) -> Iterator[list[str]]:
    ports = free_ports(2)
    procs = [start(serve_args(model_dir, p, redis_url, mooncake_master.address)) for p in ports]
    try:
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        for proc, url in zip(procs, urls):
            wait_up(proc, f"{url}/health")
        yield urls
    finally:
        for proc in procs:
            stop(proc)


def generate(url: str, prompt: list[int], salt: str) -> dict:
    body = msgspec.json.encode(GenerateRequest(prompt, SamplingParams(max_tokens=4, temperature=0.0), model="tiny",
                                               cache_salt=salt))
    response = httpx.post(f"{url}/v1/generate", content=body, headers=AUTH, timeout=60)
    events = [json.loads(line) for line in response.text.splitlines() if line.strip()]
    assert events[-1]["event"] == "finish", events[-1]
    return {"tokens": [t for e in events if e["event"] == "token" for t in e["token_ids"]], **events[-1]}


def test_a_second_worker_serves_the_first_workers_prompt_from_the_store(two_workers: list[str],
                                                                        redis_url: str) -> None:
    prompt = [random.randrange(3, 320) for _ in range(70)]  # 4 full blocks; (70 - 1) // 16 = 4 shareable
    first = generate(two_workers[0], prompt, "tenant-1")
    assert first["cached_tokens"] == 0
    r = redis.Redis.from_url(redis_url)
    keys = [store_block_key("tiny", h) for h in block_hashes(prompt, 16, "tenant-1")]
    deadline = time.monotonic() + 15
    while r.exists(*keys) < 4:  # put after prefill, then published by the worker's KV-event publisher
        assert time.monotonic() < deadline, "the store-tier events never reached the index"
        time.sleep(0.05)
    second = generate(two_workers[1], prompt, "tenant-1")
    assert second["tokens"] == first["tokens"] and second["cached_tokens"] == 64
    assert generate(two_workers[1], prompt, "tenant-2")["cached_tokens"] == 0  # another tenant: nothing shared
    store = httpx.get(f"{two_workers[1]}/stats", headers=AUTH).json()["kv_store"]  # the worker's own account
    assert store["ready"] and store["imported_blocks"] == 4 and store["fetch_hit_blocks"] >= 4
    raw = r.get(record_key("tiny", f"127.0.0.1:{two_workers[1].rsplit(':', 1)[1]}"))
    assert msgspec.json.decode(raw, type=WorkerRecord).kv_store  # routers give it the store's credit
    r.close()


@pytest.mark.parametrize("flags,message", [
    (["--kv-store", "127.0.0.1:1"], "needs --prefix-caching"),
    (["--kv-store", "nowhere", "--prefix-caching"], "host:port"),
    (["--kv-store", "127.0.0.1:1", "--prefix-caching", "--role", "decode", "--prefill-worker", "http://x"],
     "unified and prefill workers"),
])
def test_settings_that_cannot_work_are_refused_before_loading(flags: list[str], message: str) -> None:
    done = subprocess.run([sys.executable, "-m", "ops.cli", "serve", "--model", "/nonexistent", *flags], env=ENV,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and message in done.stderr + done.stdout, done.stderr


def test_up_starts_an_embedded_master_and_stops_it_with_the_cluster(tmp_path: Path) -> None:
    import argparse
    import socket

    from ops.cluster import kv_store_master
    from ops.cluster_record import new_record, read_record, write_record
    from ops.serve import add_engine_args, add_kv_store_args, check_kv_store_args, kv_store_worker_argv

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    add_kv_store_args(parser, up=True)
    assert parser.parse_args([]).kv_store is None
    args = parser.parse_args(["--kv-store"])
    try:
        check_kv_store_args(args, worker=False)
    except Exception as exc:  # noqa: BLE001 - MooncakeUnavailable where the library cannot load
        pytest.skip(str(exc))
    with kv_store_master(args.kv_store) as address:
        host, port = address.rsplit(":", 1)
        socket.create_connection((host, int(port)), timeout=2).close()  # listening
        assert kv_store_worker_argv(args, address)[:2] == ["--kv-store", address]
        write_record(new_record(gateway_url="http://g", redis_url="redis://r", worker_urls=[], worker_pids=[],
                                model="m", tenant_id="t", token="k", kv_store=address), tmp_path)
        assert read_record(tmp_path).kv_store == address
    with pytest.raises(OSError):
        socket.create_connection((host, int(port)), timeout=2).close()  # stopped with the context
    with kv_store_master("10.1.2.3:5000") as given:
        assert given == "10.1.2.3:5000"  # a cluster's own master: used as is, nothing started
    with kv_store_master(None) as none:
        assert none == "" and kv_store_worker_argv(args, none) == []
    old = (tmp_path / "cluster.json").read_text().replace(f'"kv_store": "{address}"', '"x": 1')
    (tmp_path / "cluster.json").write_text(old)  # a record written before the field existed still reads
    assert read_record(tmp_path).kv_store == ""
