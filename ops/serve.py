"""`edgeserve serve`: run one worker on a model, in role unified, prefill or decode.

    edgeserve serve --role prefill --port 8101 --prefix-caching --redis-url redis://...
    edgeserve serve --role decode  --port 8100 --kv-format fp8_e4m3 --prefill-worker http://127.0.0.1:8101

`ENGINE_OPTIONS` lists the engine flags so `edgeserve up` can forward them to
the worker it starts.

The worker token comes from `--worker-token` or `$EDGESERVE_WORKER_TOKEN` (see
`backend/worker.py`); without one the worker serves only on loopback, unless
`--insecure-no-worker-token`. SIGTERM or Ctrl-C drains it: it leaves the registry,
refuses new work (503 Draining), lets in-flight requests finish for up to
`--drain-timeout` seconds, ends the rest with `Draining`, and exits 0.

KV store tier (`backend/kv_store_tier.py`): with `--kv-store HOST:PORT` (a Mooncake
master; `edgeserve up --kv-store` starts one) a unified or prefill worker with
`--prefix-caching` puts its prompts' full blocks into the cluster-wide store after
prefill and, on a local miss, fetches the blocks another worker computed instead of
recomputing them, waiting at most `--kv-store-timeout` seconds per request. It lends
`--kv-store-segment` bytes of its memory to the store. A store that is down or slow is
skipped; requests never fail for it.

    edgeserve serve --prefix-caching --kv-store 127.0.0.1:50051 --redis-url redis://...

Tensor parallelism (one worker = a group of ranks, `backend/distributed/`):

    edgeserve serve --tensor-parallel 3 [--expert-parallel]      # spawns ranks 1, 2 itself
    torchrun --nproc-per-node 3 -m ops.cli serve --tensor-parallel 3 ...   # or under torchrun

Rank 0 is this process: HTTP, scheduler, sampling, integrity check, registration. The
other ranks hold their shards and run each step rank 0 sends; a rank that dies (or hangs
past `--tp-timeout`) stops the worker: in-flight requests end with a typed error, the
worker leaves the registry and /health turns 503. Every role: a prefill or decode group
sends or receives the whole model's KV heads through its rank 0 (`distributed/kv_exchange.py`),
so groups of different sizes pair up.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kernels.cpu_prebuild import Prebuild

__all__ = ["register", "DEFAULT_MODEL", "parse_bytes", "add_engine_args", "add_worker_token_args", "add_drain_arg",
           "add_kv_store_args", "check_kv_store_args", "kv_store_worker_argv", "ENGINE_OPTIONS", "NEGATABLE_OPTIONS",
           "EMBEDDED_KV_STORE"]

DEFAULT_MODEL = "smollm2-135m"
EMBEDDED_KV_STORE = "embedded"  # `up --kv-store` with no address: start a mooncake_master
log = logging.getLogger(__name__)


def parse_bytes(text: str) -> int:
    """'256M', '2G', '1048576' -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]?)(?:i?b)?\s*", text.lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 512M, 2G)")
    return int(float(match.group(1)) * {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}[match.group(2)])


def _buckets(text: str) -> tuple[int, ...]:
    """'8,32,128' -> (8, 32, 128); 'none' -> ()."""
    if text.strip().lower() in ("none", ""):
        return ()
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of row counts: {text!r} (e.g. 8,32,128 or none)") from None


def add_engine_args(p: argparse.ArgumentParser, listener: str = "the worker") -> None:
    """Model and engine flags shared by `serve` and `up`; --host and --port are where `listener` listens."""
    p.add_argument("--model", default=DEFAULT_MODEL, help="model name to pull, or a Hugging Face-format folder")
    p.add_argument("--served-name", default=None,
                   help="the name clients and the gateway use for the model (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help=f"address {listener} listens on")
    p.add_argument("--port", type=int, default=8100, help=f"port {listener} listens on")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="compute dtype (auto: bfloat16 on CUDA and on CPUs with AMX or AVX-512 BF16, float32 on "
                        "other CPUs, where it is the fast one)")
    p.add_argument("--kv-format", default="auto", choices=["auto", "fp32", "bf16", "fp8_e4m3"],
                   help="how the KV cache stores keys and values (auto: the compute dtype's own, fp32 or bf16; "
                        "fp8_e4m3: a quarter of fp32's memory)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where the model runs (cuda needs a CUDA build of PyTorch)")
    p.add_argument("--kv-cache-bytes", type=parse_bytes, default="512M",
                   help="memory for the KV cache (e.g. 512M, 2G): bounds how many tokens are held at once")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV cache page")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt plus reply, in tokens (default: the model's context length)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="most requests decoded together in one step")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="most tokens computed in one step")
    p.add_argument("--prefill-chunk-size", type=int, default=256,
                   help="a long prompt is computed in chunks of this many tokens, between decode steps "
                        "(a prompt alone, nothing else running or waiting, takes the whole step budget)")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="requests that may queue for a slot; more are refused (429)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--gemm-buckets", type=_buckets, default=None,
                   help="row counts to pre-pack float32 weights for (default 8,32,128; each costs one copy of "
                        "the weights, 0.54 GB for SmolLM2-135M); 'none' packs nothing")
    p.add_argument("--prefix-caching", action="store_true",
                   help="share cached prompt blocks between requests (prefill and unified roles)")
    weights = ["fp32", "bf16", "fp8", "int4"]  # backend/weight_formats.py; default: as the checkpoint stores them
    p.add_argument("--prefill-weights", default=None, choices=weights,
                   help="linear-layer format for prompt tokens (default: as stored; dense in --dtype)")
    p.add_argument("--decode-weights", default=None, choices=weights,
                   help="linear-layer format for decode tokens, also in steps mixed with prompts (default: as stored); "
                        "a format other than "
                        "--prefill-weights holds a second copy of the linear layers")
    p.add_argument("--int4-group-size", type=int, default=128, choices=[32, 64, 128, 256],
                   help="INT4 weights: values per scale group along K")
    p.add_argument("--lm-head-weights", default=None, choices=["int8"],
                   help="int8: an 8-bit copy of the LM head (one scale a row) for steps of few logits rows, where it "
                        "measured faster (CPU; perplexity +0.1%% on SmolLM2); default: the head as loaded")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="decode steps replay CUDA graphs captured per batch size (one launch a step instead of "
                        "hundreds; dense attention models in one process); default: on with --device cuda")


# engine flags `up` forwards to its worker unchanged (dest names)
ENGINE_OPTIONS = ("dtype", "kv_format", "device", "kv_cache_bytes", "page_size", "max_model_len", "max_num_seqs",
                  "max_num_batched_tokens", "prefill_chunk_size", "max_waiting", "threads", "prefix_caching",
                  "prefill_weights", "decode_weights", "int4_group_size", "lm_head_weights", "cuda_graphs")
NEGATABLE_OPTIONS = ("cuda_graphs",)  # of ENGINE_OPTIONS: --X / --no-X, None when neither is given


def register(subparsers: argparse._SubParsersAction) -> None:
    serve = subparsers.add_parser("serve", help="run one worker (role unified, prefill or decode)")
    add_engine_args(serve)
    serve.add_argument("--role", default="unified", choices=["unified", "prefill", "decode"],
                       help="unified runs whole requests; prefill and decode split them between two workers")
    serve.add_argument("--prefill-worker", action="append", default=[],
                       help="decode role: a prefill worker's URL (repeat for several; default: none, the gateway "
                            "names one per request from the Redis registry)")
    serve.add_argument("--kv-wire", default="fp8_e4m3", choices=["fp8_e4m3", "bf16"],
                       help="decode role: KV format on the wire from prefill workers")
    serve.add_argument("--kv-transport", default="http", choices=["http", "mooncake"],
                       help="decode role: how prefill workers send the KV: frames in the HTTP response (http), or "
                            "written by the prefill worker straight into this worker's reserved pages over the "
                            "Mooncake Transfer Engine (mooncake; TCP, or RDMA with EDGESERVE_MOONCAKE_PROTOCOL=rdma); "
                            "a prefill worker whose pool cannot take a direct write falls back to frames")
    add_kv_store_args(serve)
    serve.add_argument("--redis-url", default=os.environ.get("REDIS_URL"),
                       help="register in this Redis (heartbeat with live load) and publish prefix-cache KV events "
                            "(default: $REDIS_URL when set, else none: not registered)")
    serve.add_argument("--worker-id", default=None, help="this worker's id in Redis (default: host:port)")
    serve.add_argument("--region", default="local", help="this worker's region (for gateways' routing)")
    serve.add_argument("--advertise-url", default=None,
                       help="the URL gateways reach this worker at (default: http://host:port)")
    serve.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                       help="ranks in this worker's group: each holds 1/N of the heads, MLP rows and vocabulary "
                            "(spawned here, or launched by torchrun with its RANK/WORLD_SIZE/MASTER_* variables)")
    serve.add_argument("--expert-parallel", action="store_true",
                       help="with --tensor-parallel: split MoE routed experts by whole experts across the ranks "
                            "(shared experts stay tensor-parallel)")
    serve.add_argument("--tp-timeout", type=float, default=60.0,
                       help="seconds a rank may be silent inside a step before the group is ended")
    add_worker_token_args(serve)
    add_drain_arg(serve)
    serve.set_defaults(func=run_serve)


def add_kv_store_args(p: argparse.ArgumentParser, up: bool = False) -> None:
    """--kv-store, --kv-store-segment, --kv-store-timeout (serve; `up` with `up=True`: the address is
    optional, and without one `up` starts a mooncake_master)."""
    if up:
        p.add_argument("--kv-store", nargs="?", const=EMBEDDED_KV_STORE, default=None, metavar="MASTER",
                       help="a cluster-wide KV store tier: workers share computed prompt blocks through Mooncake "
                            "Store; with no address, a mooncake_master is started on a free port and stopped "
                            "with the cluster (default: no store)")
    else:
        p.add_argument("--kv-store", default=os.environ.get("EDGESERVE_KV_STORE"), metavar="MASTER",
                       help="the Mooncake master (host:port) of the cluster's KV store: put prompt blocks after "
                            "prefill, fetch other workers' blocks on a local miss; needs --prefix-caching "
                            "(default: $EDGESERVE_KV_STORE, else none)")
    p.add_argument("--kv-store-segment", type=parse_bytes, default="512M",
                   help="memory this worker lends to the KV store (e.g. 512M, 2G)")
    p.add_argument("--kv-store-timeout", type=float, default=0.15,
                   help="seconds a request may wait for its blocks from the KV store; what has not arrived by "
                        "then is recomputed")


def check_kv_store_args(args: argparse.Namespace, worker: bool = True) -> None:
    """Refuse --kv-store settings that cannot work, before anything loads (InvalidRequest or, when the
    library is missing, MooncakeUnavailable). `worker`: a `serve` command line (role, prefix caching and
    tensor parallelism are checked too); `up` sets its worker's itself."""
    from backend.errors import InvalidRequest

    if not args.kv_store:
        return
    if args.kv_store != EMBEDDED_KV_STORE:
        from backend.kv_store_client import parse_master_address

        parse_master_address(args.kv_store)
    if worker and args.role == "decode":
        raise InvalidRequest("--kv-store is for unified and prefill workers (a decode worker's KV comes from its "
                             "prefill worker)")
    if worker and not args.prefix_caching:
        raise InvalidRequest("--kv-store needs --prefix-caching (the store is the prefix cache's second tier)")
    if worker and args.tensor_parallel > 1:
        raise InvalidRequest("--kv-store needs --tensor-parallel 1 (a block holds the whole model's KV heads)")
    if not 0 < args.kv_store_timeout <= 10:
        raise InvalidRequest(f"--kv-store-timeout must be in (0, 10] seconds, got {args.kv_store_timeout}")
    from backend.mooncake_runtime import load

    load()


def kv_store_worker_argv(args: argparse.Namespace, address: str) -> list[str]:
    """The --kv-store flags `up` passes to its worker for the master at `address` ([] without one)."""
    if not address:
        return []
    return ["--kv-store", address, "--kv-store-segment", str(args.kv_store_segment),
            "--kv-store-timeout", str(args.kv_store_timeout)]


def add_worker_token_args(p: argparse.ArgumentParser) -> None:
    """--worker-token and --insecure-no-worker-token (serve and gateway)."""
    p.add_argument("--worker-token", default=None,
                   help="shared secret between gateways and workers (default: $EDGESERVE_WORKER_TOKEN; the "
                        "environment keeps it out of `ps`)")
    p.add_argument("--insecure-no-worker-token", action="store_true",
                   help="allow a worker without a token on a non-loopback address (anyone who reaches it can "
                        "call it; default: refuse)")


def add_drain_arg(p: argparse.ArgumentParser) -> None:
    """--drain-timeout (serve, gateway and up)."""
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM/Ctrl-C, seconds in-flight requests may run on before they are ended with a "
                        "typed Draining error (a second signal ends them at once)")


def run_serve(args: argparse.Namespace) -> int:
    from backend.worker_auth import check_bind, resolve_token

    token = resolve_token(args.worker_token)
    warning = check_bind(args.host, token, args.insecure_no_worker_token)  # before torch and the model load
    check_kv_store_args(args)

    from backend.cpu_features import resolve_dtype, resolve_kv_format
    from backend.engine import EngineConfig, LLMEngine
    from ops.pull import resolve_model

    model_dir = resolve_model(args.model)
    prebuild = None
    if args.device == "cpu":  # the C kernels build while the model loads, not in the first request's step
        from kernels.cpu_prebuild import start_prebuild

        prebuild = start_prebuild()
    dtype = resolve_dtype(args.dtype, args.device)
    engine_threads = None
    if args.tensor_parallel == 1:  # torch's OpenMP pool belongs to the engine thread (kernels/cpu_threads.py)
        from kernels.cpu_threads import yield_openmp_to_engine_thread

        engine_threads = yield_openmp_to_engine_thread(args.threads)
    config = EngineConfig(dtype=dtype, kv_format=resolve_kv_format(args.kv_format, dtype),
                          kv_cache_bytes=args.kv_cache_bytes, page_size=args.page_size, max_model_len=args.max_model_len,
                          max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          prefill_chunk_size=args.prefill_chunk_size, max_waiting=args.max_waiting,
                          num_threads=args.threads if engine_threads is None else None, device=args.device,
                          prefix_caching=args.prefix_caching and args.role != "decode",
                          # a prefill (decode) worker runs only prefill (decode) steps: hold one format
                          prefill_weights=args.decode_weights if args.role == "decode" else args.prefill_weights,
                          decode_weights=args.prefill_weights if args.role == "prefill" else args.decode_weights,
                          int4_group_size=args.int4_group_size, tensor_parallel=args.tensor_parallel,
                          expert_parallel=args.expert_parallel, cuda_graphs=args.cuda_graphs,
                          lm_head_weights=args.lm_head_weights)
    group = None
    if args.tensor_parallel > 1:
        from backend.distributed.group import GroupSpec, start_group

        _kernels_built(prebuild)  # before the followers start: they load what this process built
        prebuild = None

        group = start_group(GroupSpec(args.tensor_parallel, str(model_dir), config, args.expert_parallel,
                                      timeout_s=args.tp_timeout))
        if group is None:  # a torchrun follower rank: its loop has ended
            return 0
    try:
        engine = LLMEngine.from_pretrained(model_dir, config, group.coll if group is not None else None)
        _kernels_built(prebuild)
        _serve_engine(args, engine, model_dir, token, warning, group, engine_threads)
    finally:
        if group is not None:
            group.shutdown()
    return 0


def _kernels_built(prebuild: Prebuild | None) -> None:
    """Wait for the CPU kernels' prebuild (`kernels/cpu_prebuild.py`; None: nothing to wait for), saying so
    where it is still running: a host's first start, or the first after an upgrade changed a kernel."""
    if prebuild is None:
        return
    if not prebuild.done():
        print("edgeserve worker: building the CPU kernels for this host (once per host and version)", flush=True)
    took = prebuild.wait()
    if took > 1.0:
        failed = prebuild.failed()
        print(f"  CPU kernels ready in {took:.1f} s" + (f"; unavailable (torch runs instead): {', '.join(failed)}"
                                                       if failed else ""), flush=True)


def _serve_engine(args: argparse.Namespace, engine: Any, model_dir: Path, token: str | None, warning: str | None,
                  group: Any, engine_threads: int | None = None) -> None:
    """Build the worker app around `engine` (rank 0 of `group` when tensor-parallel) and serve until drained;
    `engine_threads`: torch's thread count on the engine thread (None: as it is)."""
    from backend.async_engine import AsyncEngine
    from backend.errors import InvalidRequest
    from backend.redis_client import redact
    from backend.worker import create_worker_app, worker_error_response
    from ops.graceful import serve

    config = engine.config
    name = args.served_name or args.model
    store_tier = None
    if args.kv_store:
        from backend.kv_store_keys import model_fingerprint
        from backend.kv_store_tier import open_store_tier
        from backend.mooncake_runtime import advertised_host

        store_tier = open_store_tier(engine, args.kv_store, model_fingerprint(model_dir),
                                     host=advertised_host(args.host), segment_bytes=args.kv_store_segment,
                                     fetch_timeout_s=args.kv_store_timeout)
    async_engine = AsyncEngine(engine, store_tier, threads=engine_threads)
    coordinator = None
    if args.role == "decode":
        from backend.decode_coordinator import DecodeCoordinator
        from backend.kv_transfer import HttpKVTransport

        if not args.prefill_worker and not args.redis_url:
            raise InvalidRequest("--role decode needs --prefill-worker URLs, or --redis-url (a gateway's router "
                                 "then names the prefill worker for each request)")
        transport = HttpKVTransport(token=token)
        if args.kv_transport == "mooncake":
            from backend.mooncake_runtime import advertised_host
            from backend.mooncake_transfer import MooncakeKVTransport

            transport = MooncakeKVTransport(engine, token=token, host=advertised_host(args.host))
        coordinator = DecodeCoordinator(async_engine, args.prefill_worker, transport,
                                        wire_format=args.kv_wire, registry_url=args.redis_url,
                                        model=name if args.redis_url else None)
    background, registration = [], None
    if args.redis_url:
        from backend.registration import Heartbeat
        from prefix_cache.kv_events import KVEventPublisher

        worker_id = args.worker_id or f"{args.host}:{args.port}"
        url = args.advertise_url or f"http://{args.host}:{args.port}"
        registration = Heartbeat(args.redis_url, lambda: _record(engine, worker_id, url, name, args)).run
        if config.prefix_caching:
            background.append(KVEventPublisher(args.redis_url, name, worker_id, engine.kv_events,
                                               dropped=lambda: engine.kv_events_dropped).run)
    app = create_worker_app(async_engine, model_name=name, role=args.role, coordinator=coordinator,
                            background=background, registration=registration, token=token,
                            group_stats=_group_stats(group, engine) if group is not None else None)
    snap = engine.snapshot()
    where = f", registered in {redact(args.redis_url)}" if args.redis_url else ""
    print(f"edgeserve worker ({args.role}) serving {name} from {model_dir} on http://{args.host}:{args.port}"
          f"{where}\n"
          f"  compute {engine.config.dtype}; KV pool: {snap['pages_total']} pages x {snap['page_size']} tokens ({snap['kv_format']}, "
          f"{snap['kv_bytes_per_token']} B/token), context {snap['max_model_len']}", flush=True)
    if store_tier is not None:
        print(f"  KV store: Mooncake master {args.kv_store} (namespace {store_tier.namespace}, lends "
              f"{args.kv_store_segment >> 20} MiB, waits at most {args.kv_store_timeout * 1000:.0f} ms per request)",
              flush=True)
    if group is not None:
        pids = ", ".join(f"rank {r} pid {p}" for r, p in group.pids.items()) or "launched by torchrun"
        print(f"  tensor parallel: {group.coll.world} ranks{' (expert parallel)' if config.expert_parallel else ''}"
              f"; weight bytes read per rank {[w['bytes_read'] for w in group.coll.rank_weights]}; followers: {pids}",
              flush=True)
    if warning:
        print(warning, flush=True)
    serve(app, args.host, args.port, drain_timeout_s=args.drain_timeout, render=worker_error_response)


def _group_stats(group: Any, engine: Any) -> Any:
    """/stats "tensor_parallel" of a tensor-parallel worker: ranks, follower pids, collectives so far."""
    def stats() -> dict[str, object]:
        return {"world_size": group.coll.world, "expert_parallel": engine.config.expert_parallel,
                "follower_pids": group.pids, "collectives": group.coll.snapshot(),
                "rank_weights": group.coll.rank_weights}
    return stats


def _record(engine, worker_id: str, url: str, name: str, args: argparse.Namespace):
    """This worker's registry record, with its live load (read on the event loop; racy reads are fine)."""
    from backend.registration import WorkerRecord

    snap = engine.snapshot()
    return WorkerRecord(id=worker_id, url=url, role=args.role, model=name, region=args.region,
                        page_size=int(snap["page_size"]), pages_total=int(snap["pages_total"]),
                        pages_free=int(snap["pages_free"]), running=int(snap["running"]),
                        waiting=int(snap["waiting"]), queued_prefill_tokens=int(snap["queued_prefill_tokens"]),
                        pages_evictable=int(snap["pages_evictable"]), kv_store=bool(args.kv_store))
