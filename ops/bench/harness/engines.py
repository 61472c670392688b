"""The in-process engine of the engine benchmarks: their `--model`, `--dtype`, `--kv-format` and its construction."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_engine_arguments", "in_process_engine"]


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """`--model` (default SmolLM2-135M), `--dtype` and `--kv-format` (default `auto`: as a worker picks them)."""
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--kv-format", default="auto", choices=["auto", "fp32", "bf16", "fp8_e4m3"])


def in_process_engine(args: argparse.Namespace, **config: Any) -> tuple[Any, Any, str]:
    """(engine, dtype, kv format): an `LLMEngine` of `args.model` with the dtype and KV format `args` ask for
    (resolved as a worker resolves `auto`) and the other `EngineConfig` fields in `config`."""
    from backend.cpu_features import resolve_dtype, resolve_kv_format
    from backend.engine import EngineConfig, LLMEngine
    from ops.pull import resolve_model

    dtype = resolve_dtype(args.dtype)
    kv = resolve_kv_format(args.kv_format, dtype)
    return LLMEngine.from_pretrained(resolve_model(args.model), EngineConfig(dtype=dtype, kv_format=kv, **config)), \
        dtype, kv
