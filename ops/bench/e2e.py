"""End to end against llama.cpp: edgeserve and `llama-server` through the same OpenAI chat endpoint.

The peer a CPU user would otherwise pick is llama.cpp's server, so this is measured
the way a user meets both: `POST /v1/chat/completions` on loopback, the same
closed-loop client, the same requests. Each format class pairs like with like:

- ``fp32``: edgeserve in float32 with fp32 KV (``--dtype float32 --kv-format fp32``)
  against llama-server on the F32 GGUF (`ops.bench.llamacpp.model_ggufs`);
- ``bf16``: edgeserve in bfloat16 with bf16 KV (what ``--dtype auto`` picks on CPUs with
  AMX) against llama-server on the BF16 GGUF (the same numbers as our weights);
- ``int4``: edgeserve with INT4 g32 decode weights (``--decode-weights int4
  --int4-group-size 32``; prompts in the host's default dtype) against llama-server on
  the Q4_1 GGUF (which also covers prompt processing and keeps an 8-bit output layer);
- ``int4-head8`` (asked for by name, not in the default list): ``int4`` plus the LM head's 8-bit copy
  (``--lm-head-weights int8``, `backend/lm_head.py`), the output layer in 8 bits as Q4_1's, against the same
  Q4_1 GGUF.

Not like for like in the KV cache: llama.cpp's is F16, ours is the compute dtype's.

Processes: edgeserve is `edgeserve up` itself (Redis, a worker, the gateway; its own
`EDGESERVE_HOME` in a temporary folder so its cluster record is not the user's, the
model passed as the pulled folder), started once per format class; llama-server
(`-t 2 -np c`, `c` slots of `--e2e-slot-context` tokens) is started per concurrency,
since its slots are fixed at start. Both stay up while the other is measured, idle.
llama.cpp's OpenMP threads spin at every barrier, which on a machine other work keeps
busy made its decode ~50x slower; `omp_wait_policy` then runs it with
``OMP_WAIT_POLICY=PASSIVE`` (the report says which).

Load: c users, each with its own HTTP connection, send non-streamed requests back to
back until the pass's requests (c x `--e2e-requests` per user) are answered. Every
request has its own prompt (~80 tokens with the chat template: a number unique to the
run, the format, c and the pass first, so no prefix cache helps either side; both
systems get the same prompts in a pass), ``max_tokens`` 95, temperature 0. Passes
alternate which system goes first, and the systems never run at once. Output
tokens/s = the responses' `usage.completion_tokens` summed / the pass's wall time.
Neither side is told to ignore EOS (the gateway has no such option): both run the
same model greedily on the same prompts, so they stop alike; the report gives each
side's mean completion tokens, so a difference shows.

In process: llama-server's own decode time per token (`timings.predicted_per_token_ms`
of its responses, mean over the pass) beside edgeserve's worker's, measured after the
passes at each c by c concurrent requests straight to the worker's `/v1/generate`
(its finish event: (total_s - ttft_s) / (completion_tokens - 1)): both leave out the
HTTP path and prompt processing.

JSON (`write_report`): ``ratio_vs_llamacpp`` maps format -> c -> edgeserve tok/s over
llama.cpp tok/s (means over passes); ``tok_s`` the same per system; ``passes`` each
pass's row; ``spread`` per system, format and c: (max - min) / mean of the passes.
Where llama.cpp cannot be built the comparator is skipped with the printed reason
(``llamacpp.available`` false, ratios null).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any, NamedTuple

from ops.bench.e2e_load import (MODEL, SYSTEMS, PassRow, chat_body, closed_loop, make_prompts, mean_tok_s,
                                pass_order, pass_row, ratios, spreads)
from ops.bench.harness.procs import busy_cpus
from ops.parent_death import own_group_dying_with_parent

__all__ = ["add_arguments", "run", "compare_end_to_end", "FORMATS", "make_prompts", "chat_body", "closed_loop",
           "PassRow", "ratios", "spreads", "pass_order", "edgeserve_up_command", "edgeserve_up", "Cluster",
           "omp_wait_policy", "end_to_end", "print_table"]

# format class -> (edgeserve's extra `up` flags, llama.cpp's GGUF key in `model_ggufs`)
_INT4 = ("--decode-weights", "int4", "--int4-group-size", "32")
FORMATS: dict[str, tuple[tuple[str, ...], str]] = {
    "fp32": (("--dtype", "float32", "--kv-format", "fp32"), "f32"),
    "bf16": (("--dtype", "bfloat16", "--kv-format", "bf16"), "bf16"),
    "int4": (_INT4, "q4_1"),
    "int4-head8": ((*_INT4, "--lm-head-weights", "int8"), "q4_1"),
}

Log = Callable[[str], None]


def omp_wait_policy(choice: str, busy: float, cpus: int) -> str:
    """"default" or "passive" for llama-server's OpenMP threads, given how many CPUs other work keeps
    `busy` now (`busy_cpus`, measured while this benchmark sleeps). Its build (OpenMP) spins at every
    barrier; when other processes hold the cores, a spinning thread burns its time slice while its
    partner waits to run, and decode took 1,000-1,800 ms/token instead of 16-32 (measured here, load
    ~3 on 2 CPUs). So "auto" picks passive waiting on a busy machine and libgomp's default on an idle
    one, where spinning is the faster (passive was 2-3x slower on an idle 2-core VM). The one-minute
    load average is not the measure: `bench engine` runs this right after its own work, which
    left it at ~2 on 2 CPUs and made an idle machine look busy."""
    if choice != "auto":
        return choice
    return "passive" if busy > 0.5 * cpus else "default"



# ---------------------------------------------------------------- edgeserve as `edgeserve up`

class Cluster(NamedTuple):
    chat_url: str
    headers: dict[str, str]  # the demo tenant's API token
    worker_url: str
    worker_token: str


def edgeserve_up_command(model_dir: Path, port: int, worker_port: int, extra: tuple[str, ...]) -> list[str]:
    return [sys.executable, "-m", "ops.cli", "up", "--model", str(model_dir), "--served-name", MODEL,
            "--port", str(port), "--worker-port", str(worker_port), *extra]


@contextlib.contextmanager
def edgeserve_up(model_dir: Path, extra: tuple[str, ...], logs: Path, timeout_s: float = 600.0
                 ) -> Iterator[Cluster]:
    """`edgeserve up` with its own home (the cluster record lands there), until the context exits."""
    import httpx

    from backend.worker_auth import TOKEN_ENV
    from ops.cluster import log_tail
    from ops.cluster_record import read_record
    from ops.redis_server import free_ports, stop_process

    home = logs / f"home-{len(list(logs.glob('home-*')))}"
    log_path = home.with_suffix(".log")
    token = secrets.token_hex(16)
    env = {**os.environ, "EDGESERVE_HOME": str(home), TOKEN_ENV: token}
    env.pop("REDIS_URL", None)  # a fresh redis-server of its own
    argv = edgeserve_up_command(model_dir, *free_ports(2), extra)
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                preexec_fn=own_group_dying_with_parent)
    try:
        deadline = time.monotonic() + timeout_s
        record = None
        while record is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"edgeserve up did not start ({proc.poll()=}); its log ends:\n{log_tail(log_path)}")
            time.sleep(0.3)
            record = read_record(home)
            with contextlib.suppress(httpx.HTTPError):
                if record is not None and httpx.get(f"{record.gateway_url}/healthz", timeout=2).status_code != 200:
                    record = None
        yield Cluster(f"{record.gateway_url}/v1/chat/completions", {"authorization": f"Bearer {record.token}"},
                       record.worker_urls[0], token)
    finally:
        stop_process(proc, timeout_s=60)


async def _worker_ms_per_token(cluster: Cluster, model_dir: Path, prompts: list[str], max_tokens: int) -> float:
    """Mean in-worker decode ms/token of `prompts` sent at once to the worker's /v1/generate."""
    import httpx
    import msgspec

    from backend.protocol import FinishEvent, GenerateRequest
    from backend.sampling_params import SamplingParams
    from backend.tokenizer import Tokenizer
    from backend.worker_auth import auth_headers

    tok = Tokenizer.from_model_dir(model_dir)

    async def one(client: httpx.AsyncClient, prompt: str) -> float | None:
        ids = tok.encode_chat([{"role": "user", "content": prompt}])
        req = GenerateRequest(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0), model=MODEL)
        resp = await client.post(f"{cluster.worker_url}/v1/generate", content=msgspec.json.encode(req),
                                 headers=auth_headers(cluster.worker_token))
        last = msgspec.json.decode(resp.content.strip().splitlines()[-1])
        if last.get("event") != "finish":
            return None
        fin = msgspec.convert(last, FinishEvent)
        n = fin.completion_tokens
        return 1e3 * (fin.total_s - (fin.ttft_s or 0.0)) / (n - 1) if n > 1 else None

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        vals = [v for v in await asyncio.gather(*(one(client, p) for p in prompts)) if v is not None]
    return statistics.fmean(vals) if vals else float("nan")


# ---------------------------------------------------------------- the comparison

def _levels(args: argparse.Namespace) -> list[int]:
    if args.e2e_concurrency:
        return [int(c) for c in args.e2e_concurrency.split(",")]
    return [1, 8] if args.quick else [1, 8, 32]


def _llamacpp(args: argparse.Namespace, log: Log) -> tuple[Any, dict[str, Path] | None, str]:
    """(the build, its GGUFs, "ok") or (None, None, why it is skipped)."""
    from ops.bench.llamacpp import LlamaCppUnavailable, ensure_llamacpp, model_ggufs

    if args.no_llamacpp:
        return None, None, "skipped (--no-llamacpp)"
    try:
        build = ensure_llamacpp(args.llamacpp_version, log=log)
        return build, model_ggufs(build, MODEL, log=log), "ok"
    except LlamaCppUnavailable as exc:
        return None, None, str(exc)


def compare_end_to_end(args: argparse.Namespace, log: Log) -> dict[str, Any]:
    """Run the comparison (module docstring) and return the report's fields; llama.cpp's absence is a
    note in ``llamacpp``, not an error."""
    from ops.bench.llamacpp import llama_server
    from ops.pull import resolve_model

    levels, formats = _levels(args), args.e2e_formats.split(",")
    per_user = args.e2e_requests or (2 if args.quick else 4)
    passes = args.e2e_passes or 2
    build, ggufs, note = _llamacpp(args, log)
    if build is None:
        log(f"llama.cpp comparator skipped: {note}")
        return {"llamacpp": {"available": False, "note": note}, "ratio_vs_llamacpp": None, "tok_s": None,
                "passes": []}
    model_dir = resolve_model(MODEL)
    run_id, load_start = secrets.token_hex(3), list(os.getloadavg())
    busy = busy_cpus(2.0) if args.llamacpp_omp_wait == "auto" else None
    omp_wait = omp_wait_policy(args.llamacpp_omp_wait, busy or 0.0, len(os.sched_getaffinity(0)))
    omp_env = {"OMP_WAIT_POLICY": "PASSIVE"} if omp_wait == "passive" else {}
    log(f"llama-server OpenMP wait policy: {omp_wait} (" + (f"{busy:.2f} CPUs busy over 2 s, " if busy is not None
                                                           else "") + f"load average {load_start[0]:.1f})")
    rows: list[PassRow] = []
    worker_ms: dict[str, dict[int, float]] = {}
    servers: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory(prefix="edgeserve-bench-e2e-") as tmp:
        logs = Path(tmp)
        for fmt in formats:
            extra, gguf_key = FORMATS[fmt]
            log(f"[{fmt}] starting edgeserve up {' '.join(extra)}".rstrip())
            with edgeserve_up(model_dir, extra, logs) as cluster:
                for ci, c in enumerate(levels):
                    with llama_server(build, ggufs[gguf_key], c, args.e2e_slot_context,
                                      logs / f"llama-{fmt}-c{c}.log", threads=args.llamacpp_threads, log=log,
                                      env=omp_env) as server:
                        servers[f"{fmt}_c{c}"] = server.argv
                        targets = {"edgeserve": (cluster.chat_url, cluster.headers),
                                   "llamacpp": (f"{server.url}/v1/chat/completions", {})}
                        for system, (url, headers) in targets.items():  # warm-up, unmeasured
                            asyncio.run(closed_loop(url, headers, make_prompts(f"{run_id}-warm-{fmt}-{c}", c), c,
                                                    8))
                        for p in range(passes):
                            prompts = make_prompts(f"{run_id}-{fmt}-c{c}-p{p}", c * per_user)
                            for pos, system in enumerate(pass_order(p, ci)):
                                url, headers = targets[system]
                                replies, errors, wall = asyncio.run(closed_loop(url, headers, prompts, c,
                                                                                args.e2e_tokens))
                                row = pass_row(system, fmt, c, p, pos, replies, errors, wall)
                                rows.append(row)
                                log(f"[{fmt}] c={c} pass {p + 1}/{passes} {system:<9} {row.tok_s:7.1f} tok/s "
                                    f"({row.requests} requests, {row.mean_completion_tokens:.1f} tokens each, "
                                    f"{wall:.1f} s){f' errors {errors}' if errors else ''}")
                    worker_ms.setdefault(fmt, {})[c] = asyncio.run(_worker_ms_per_token(
                        cluster, model_dir, make_prompts(f"{run_id}-probe-{fmt}-{c}", c), args.e2e_tokens))
    llama_ms: dict[str, dict[int, float | None]] = {}
    for fmt, c in dict.fromkeys((r.fmt, r.concurrency) for r in rows):
        vals = [r.in_process_ms_per_token for r in rows if (r.system, r.fmt, r.concurrency) == ("llamacpp", fmt, c)
                and r.in_process_ms_per_token is not None]
        llama_ms.setdefault(fmt, {})[c] = statistics.fmean(vals) if vals else None
    return {
        "llamacpp": {"available": True, "note": note, "version": f"llama-cpp-python {build.version}",
                     "ggufs": {k: str(v) for k, v in ggufs.items()}, "server_argv": servers},
        "config": {"concurrency": levels, "formats": formats, "passes": passes, "requests_per_user": per_user,
                   "max_tokens": args.e2e_tokens, "slot_context": args.e2e_slot_context,
                   "llamacpp_threads": args.llamacpp_threads, "llamacpp_omp_wait": omp_wait,
                   "edgeserve_flags": {f: list(FORMATS[f][0]) for f in formats},
                   "load_average_start": load_start, "busy_cpus_start": busy},
        "ratio_vs_llamacpp": ratios(rows),
        "tok_s": {fmt: {s: {c: mean_tok_s(rows, s, fmt, c) for c in levels} for s in SYSTEMS} for fmt in formats},
        "in_process_ms_per_token": {fmt: {"llamacpp": llama_ms.get(fmt, {}), "edgeserve_worker": worker_ms.get(fmt, {})}
                                    for fmt in formats},
        "spread": spreads(rows),
        "passes": [asdict(r) for r in rows],
    }


def print_table(report: dict[str, Any]) -> None:
    if not report.get("passes"):
        print(f"llama.cpp comparator: {report['llamacpp']['note']}")
        return
    print(f"{'format':<11}{'c':>4}{'llama.cpp tok/s':>17}{'edgeserve tok/s':>17}{'ratio':>8}{'spread l/e':>13}"
          f"{'tokens l/e':>13}{'in-proc ms/tok l/e':>21}")
    sp = report["spread"]
    for fmt, per_c in report["ratio_vs_llamacpp"].items():
        for c, ratio in per_c.items():
            tok = report["tok_s"][fmt]
            mean_tokens = {s: statistics.fmean([r["mean_completion_tokens"] for r in report["passes"]
                                                if (r["system"], r["fmt"], r["concurrency"]) == (s, fmt, c)])
                           for s in SYSTEMS}
            ms = report["in_process_ms_per_token"][fmt]
            lms, ems = ms["llamacpp"].get(c), ms["edgeserve_worker"].get(c)
            fmt_ms = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
            print(f"{fmt:<11}{c:>4}{tok['llamacpp'][c]:>17.1f}{tok['edgeserve'][c]:>17.1f}"
                  f"{'-' if ratio is None else f'{ratio:.2f}x':>8}"
                  f"{sp['llamacpp'][fmt][c]:>7.0%}/{sp['edgeserve'][fmt][c]:<5.0%}"
                  f"{mean_tokens['llamacpp']:>7.1f}/{mean_tokens['edgeserve']:<5.1f}"
                  f"{fmt_ms(lms):>14}/{fmt_ms(ems):<6}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--e2e-concurrency", default=None, help="comma-separated c (default 1,8,32; quick 1,8)")
    p.add_argument("--e2e-formats", default="fp32,bf16,int4",
                   help="format classes: fp32, bf16, int4, int4-head8 (default: the first three)")
    p.add_argument("--e2e-passes", type=int, default=None, help="passes per system and c (default 2)")
    p.add_argument("--e2e-requests", type=int, default=None, help="requests per user per pass (default 4; quick 2)")
    p.add_argument("--e2e-tokens", type=int, default=95, help="max_tokens of each request (default 95)")
    p.add_argument("--e2e-slot-context", type=int, default=256, help="llama-server context per slot (default 256)")
    p.add_argument("--llamacpp-threads", type=int, default=2, help="llama-server -t (default 2)")
    p.add_argument("--llamacpp-omp-wait", default="auto", choices=["auto", "default", "passive"],
                   help="llama-server's OpenMP threads: libgomp's spinning default, or OMP_WAIT_POLICY=PASSIVE "
                        "(auto: passive when other work keeps over half the CPUs busy, measured over 2 s)")
    p.add_argument("--llamacpp-version", default=None, help="llama-cpp-python sdist to build llama.cpp from")
    p.add_argument("--no-llamacpp", action="store_true", help="skip the llama.cpp comparator")


def end_to_end(args: argparse.Namespace) -> dict[str, Any]:
    """Run the comparison, print its table and return the report's fields (also `bench engine`'s
    ``end_to_end`` section)."""
    from ops.bench.harness.progress import log
    from ops.bench.llamacpp import VERSION

    args.llamacpp_version = args.llamacpp_version or VERSION
    started = time.perf_counter()
    report = compare_end_to_end(args, log)
    report = {"quick": args.quick, **report, "total_s": time.perf_counter() - started,
              "load_average_end": list(os.getloadavg())}
    print(f"\nend to end through /v1/chat/completions, edgeserve (`edgeserve up`) vs llama.cpp's llama-server"
          f"{' (quick)' if args.quick else ''}; ratio = edgeserve / llama.cpp")
    print_table(report)
    return report


def run(args: argparse.Namespace) -> int:
    from ops.bench import write_report

    report = end_to_end(args)
    write_report(args.json_path, report)
    return 0
