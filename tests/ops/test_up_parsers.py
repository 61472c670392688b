"""`edgeserve up --tool-parser / --reasoning-parser` reach its gateway as `edgeserve gateway`'s flags do:
parsed by the real CLI parser, turned into the gateway config `up` serves, read by the gateway's model
catalog (no cluster is started); `--[no-]cuda-graphs` reaches its worker's command line as given."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from gateway.reasoning_parsers import REASONING_PARSERS
from gateway.served_models import ServedModel
from gateway.tool_parsers import TOOL_PARSERS
from ops.cli import build_parser
from ops.up import REASONING_PARSER_CHOICES, TOOL_PARSER_CHOICES, gateway_config


def _served(model_dir: Path, *flags: str) -> ServedModel:
    args = build_parser("up").parse_args(["up", "--model", str(model_dir), *flags])
    args.served_name = "tiny-chat"  # what `up` sets before building the config
    config = gateway_config(args, str(model_dir), "redis://127.0.0.1:1", 512, "worker-token")
    (route,) = config.models
    assert route.workers == [] and config.worker_token == "worker-token" and route.max_model_len == 512
    return ServedModel(route)


def test_parsers_named_on_up_are_the_gateways(tiny_chat_dir: Path) -> None:
    default = _served(tiny_chat_dir)  # a Llama config: hermes, no reasoning split
    assert default.tool_parser is TOOL_PARSERS["hermes"] and default.reasoning_parser is None
    chosen = _served(tiny_chat_dir, "--tool-parser", "kimi_k2", "--reasoning-parser", "qwen3")
    assert chosen.tool_parser is TOOL_PARSERS["kimi_k2"] and chosen.reasoning_parser is REASONING_PARSERS["qwen3"]
    off = _served(tiny_chat_dir, "--tool-parser", "glm45", "--reasoning-parser", "none")
    assert off.tool_parser is TOOL_PARSERS["glm45"] and off.reasoning_parser is None


def _choices(command: str, flag: str) -> list[str]:
    parser = build_parser(command)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    (action,) = [a for a in sub._actions if flag in a.option_strings]
    return list(action.choices)


def test_up_offers_exactly_the_gateways_choices() -> None:
    assert _choices("up", "--tool-parser") == _choices("gateway", "--tool-parser") == list(TOOL_PARSER_CHOICES)
    assert sorted(TOOL_PARSER_CHOICES) == sorted(TOOL_PARSERS)
    assert _choices("up", "--reasoning-parser") == _choices("gateway", "--reasoning-parser")
    assert sorted(REASONING_PARSER_CHOICES) == sorted([*REASONING_PARSERS, "none"])


def test_an_unknown_parser_is_refused_by_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser("up").parse_args(["up", "--reasoning-parser", "deepseek_v3"])
    assert info.value.code == 2 and "--reasoning-parser" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "forwarded"), [((), []), (("--cuda-graphs",), ["--cuda-graphs"]),
                                                  (("--no-cuda-graphs",), ["--no-cuda-graphs"])])
def test_up_forwards_the_cuda_graphs_choice_to_its_worker(flags: tuple[str, ...], forwarded: list[str]) -> None:
    """Neither flag leaves the worker's default (on with a CUDA device); either one reaches it as given."""
    from ops.up import _worker_argv

    args = build_parser("up").parse_args(["up", "--model", "m", *flags])
    args.served_name, args.worker_port = "m", 1
    argv = _worker_argv(args, "m")
    assert [a for a in argv if "cuda-graphs" in a] == forwarded
    serve = build_parser("serve").parse_args(argv[argv.index("serve"):])
    assert serve.cuda_graphs == {(): None, ("--cuda-graphs",): True, ("--no-cuda-graphs",): False}[flags]


def test_up_forwards_the_lm_head_format_to_its_worker() -> None:
    from ops.up import _worker_argv

    for flags, want in (((), None), (("--lm-head-weights", "int8"), "int8")):
        args = build_parser("up").parse_args(["up", "--model", "m", *flags])
        args.served_name, args.worker_port = "m", 1
        argv = _worker_argv(args, "m")
        assert build_parser("serve").parse_args(argv[argv.index("serve"):]).lm_head_weights == want
