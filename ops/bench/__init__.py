"""`edgeserve bench <name>`: benchmark commands (each prints a table and writes JSON).

One module (or subpackage, for the large ones) per benchmark, each with `add_arguments(parser)`
and `run(args) -> int`, registered in `BENCHES`; every `run` writes its JSON through
`ops.bench.report.write_report`. What the benchmarks share (statistics, engine loops, prompts,
process CPU and logs, tenants, machine load, plots) is in `ops.bench.harness`.
"""

from __future__ import annotations

import argparse
import importlib

from ops.bench.report import provenance, recording_start, write_report

__all__ = ["register", "BENCHES", "write_report", "provenance"]

# bench name -> module with `add_arguments(parser)` and `run(args) -> int`
BENCHES: dict[str, str] = {
    "engine": "ops.bench.engine",
    "token-profile": "ops.bench.token_profile",
    "e2e": "ops.bench.e2e",
    "kv-capacity": "ops.bench.kv",
    "kernels": "ops.bench.kernels",
    "cpu-kernels": "ops.bench.cpu_kernels",
    "integrity": "ops.bench.integrity",
    "gateway": "ops.bench.gateway",
    "routing": "ops.bench.routing",
    "pd": "ops.bench.pd",
    "weights": "ops.bench.weights",
    "soak": "ops.bench.soak",
    "moe": "ops.bench.moe",
    "mla": "ops.bench.mla",
    "structured": "ops.bench.structured",
    "tp": "ops.bench.tp",
    "sass": "ops.bench.sass",
    "tokenize": "ops.bench.tokenize",
    "prefill": "ops.bench.prefill",
    "prefix-burst": "ops.bench.prefix_burst",
    "fairness": "ops.bench.fairness",
    "all": "ops.bench.all",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `bench` and one subcommand per benchmark, each with `--quick` and `--json` and its own flags."""
    bench = subparsers.add_parser("bench", help="run a benchmark")
    which = bench.add_subparsers(dest="bench", required=True)
    for name, module_name in BENCHES.items():
        module = importlib.import_module(module_name)
        p = which.add_parser(name, help=(module.__doc__ or "").splitlines()[0])
        p.add_argument("--quick", action="store_true", help="a short run (smoke test of the command)")
        p.add_argument("--json", dest="json_path", default=f"bench-results/{name}.json", help="where to write JSON")
        module.add_arguments(p)
        p.set_defaults(func=recording_start(module.run))
