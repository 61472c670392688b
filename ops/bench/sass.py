"""Static figures of the GPU kernels' hot loops: compiled for an H100/H200 (sm_90) on any machine, no GPU.

A kernel's launcher runs on CPU tensors of a real shape with the kernel's launch intercepted
(`captured_launch`): the arguments it would have passed are turned into the signature and the
specialisations Triton would use on a GPU (pointers and integers divisible by 16 marked so, as
its launcher does), compiled for `ARCH` with the wheel's own `ptxas`, and disassembled with its
`cuobjdump`. Per kernel: registers a thread, and the hottest loop's body (the largest loop,
found by its backward branch): instructions by opcode, global loads by width, and

    instructions per byte = loop instructions / bytes a thread reads from memory per iteration

(weight bytes for the INT4 kernels; K, V and their scales for paged attention), and the warps a
multiprocessor can hold at once given the registers and shared memory (`resident_warps`). A streaming
multiprocessor issues at most 4 warp instructions a cycle (128 thread instructions), so

    issue ceiling = SMs * clock * 128 / instructions per byte

bytes per second (H200: 132 SMs at 1.98 GHz) is what the loop could read if issue were its only
limit; a kernel below it is waiting on memory (bytes in flight: few resident warps hide little
latency) or on a busy pipe (INT32 runs at half the FP32 rate). These are counts, not timings: a
change that cuts instructions a byte raises the ceiling, and only a GPU run (`ops/gpu_check.sh`)
says whether the time follows.

Cases: the INT4 GEMV at M = 1 (Llama-3-8B's 4096 x 4096, its three forms, g = 128 and 32), paged
decode attention over BF16 and FP8 pages, FP8 also with V in pairs (32 query / 8 KV heads of 128, the
launcher's tiles),
the W4A16 GEMM's tiled path (M = 64) and the fused MoE's gate-up kernel over INT4 experts.
`--quick`: g = 128, FP8 pages (both ways) and the tiled GEMM only.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import os
import re
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ops.bench.report import write_report

__all__ = ["add_arguments", "run", "captured_launch", "compile_sass", "Compiled", "resident_warps", "hot_loop",
           "LoopFigures", "CASES"]

ARCH = 90  # sm_90: H100 / H200
SMS, CLOCK_HZ = 132, 1.98e9  # an H200's multiprocessors and boost clock
ISSUE_PER_SM_CLOCK = 128  # thread instructions: 4 schedulers x one warp instruction of 32 threads
SM_LIMITS = {"registers": 65536, "shared_bytes": 233472, "blocks": 32, "warps": 64}  # per multiprocessor, sm_90

_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.uint8: "u8",
          torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.bool: "i1",
          torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}
_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[0-9T]\s+)?([A-Z0-9_]+)(\S*)\s*([^;]*);")


@contextlib.contextmanager
def captured_launch(kernel: Any) -> Iterator[list[dict[str, Any]]]:
    """Within the block, `kernel[grid](...)` records its arguments (a dict per launch: `args` by
    name, `options` such as num_warps) instead of running."""
    launches: list[dict[str, Any]] = []

    def record(*args: Any, grid: Any = None, warmup: bool = False, **kwargs: Any) -> None:
        options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
        launches.append({"args": {**dict(zip(kernel.arg_names, args)), **kwargs}, "options": options})

    kernel.run = record  # an instance attribute: shadows JITFunction.run for this kernel only
    try:
        yield launches
    finally:
        del kernel.run


def _toolchain() -> Path:
    import triton

    found = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump"))
    if not found:
        raise RuntimeError("this triton wheel ships no cuobjdump (backends/nvidia/bin)")
    return Path(found[0]).parent


class Compiled(NamedTuple):
    sass: str
    registers: int  # a thread
    shared_bytes: int  # a block
    warps: int  # a block


def compile_sass(kernel: Any, launch: dict[str, Any]) -> Compiled:
    """`kernel` compiled for sm_`ARCH` with a captured launch's arguments."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexpr_names = {kernel.arg_names[i] for i in kernel.constexprs}
    signature, constants, attrs = {}, {}, {}
    for i, name in enumerate(kernel.arg_names):
        value = launch["args"].get(name, kernel.params[i].default)
        if name in constexpr_names:
            signature[name], constants[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _TYPES[value.dtype]
            aligned = value.data_ptr() % 16 == 0
        elif isinstance(value, bool):
            signature[name], aligned = "i1", False
        elif isinstance(value, int):
            signature[name], aligned = ("i32" if -2**31 <= value < 2**31 else "i64"), value % 16 == 0
        elif isinstance(value, float):
            signature[name], aligned = "fp32", False
        else:
            raise TypeError(f"{name}: cannot type {type(value).__name__}")
        if name not in constexpr_names and aligned:  # what Triton's launcher specialises on a GPU
            attrs[(i,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs),
                              target=GPUTarget("cuda", ARCH, 32), options=dict(launch["options"]))
    bin_dir = _toolchain()
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        sass = subprocess.run([str(bin_dir / "cuobjdump"), "-sass", str(cubin)], check=True, capture_output=True,
                              text=True).stdout
        usage = subprocess.run([str(bin_dir / "cuobjdump"), "-res-usage", str(cubin)], check=True,
                               capture_output=True, text=True).stdout
    return Compiled(sass, int(re.search(r"REG:(\d+)", usage).group(1)), int(compiled.metadata.shared),
                    int(compiled.metadata.num_warps))


def resident_warps(registers: int, shared_bytes: int, warps: int) -> int:
    """Warps a multiprocessor holds at once (`SM_LIMITS`: registers allocated per warp in units of 256, shared
    memory per block plus 1 KB reserved, blocks and warps capped): the warps its schedulers can switch between
    while others wait on memory. An estimate from the public limits, not the occupancy calculator."""
    regs_per_warp = -(-registers * 32 // 256) * 256
    by_regs = SM_LIMITS["registers"] // (regs_per_warp * warps)
    by_smem = SM_LIMITS["shared_bytes"] // (shared_bytes + 1024)
    blocks = min(by_regs, by_smem, SM_LIMITS["blocks"], SM_LIMITS["warps"] // warps)
    return blocks * warps


def hot_loop(sass: str) -> list[tuple[str, str]]:
    """(opcode, suffix) of each instruction in the largest loop body (from a backward branch's target to it)."""
    lines = [(int(m.group(1), 16), m.group(2), m.group(3), m.group(4)) for m in _LINE.finditer(sass)]
    best: list[tuple[str, str]] = []
    for addr, op, _, operands in lines:
        target = re.search(r"0x([0-9a-f]+)", operands) if op == "BRA" else None
        if target and int(target.group(1), 16) < addr:
            body = [(o, s) for a, o, s, _ in lines if int(target.group(1), 16) <= a <= addr]
            best = max(best, body, key=len)
    return best


class LoopFigures(dict):
    """One kernel's figures (a dict, for the JSON)."""

    @classmethod
    def of(cls, name: str, compiled: Compiled, bytes_per_thread: float) -> LoopFigures:
        body = hot_loop(compiled.sass)
        ops = collections.Counter(op for op, _ in body)
        loads = collections.Counter(op + suffix for op, suffix in body if op in ("LDG", "LDGSTS", "LDS"))
        per_byte = len(body) / bytes_per_thread if body else float("nan")
        return cls(name=name, registers=compiled.registers, shared_bytes=compiled.shared_bytes, warps=compiled.warps,
                   resident_warps=resident_warps(compiled.registers, compiled.shared_bytes, compiled.warps),
                   loop_instructions=len(body), bytes_per_thread=bytes_per_thread,
                   instructions_per_byte=per_byte,
                   issue_ceiling_gb_s=SMS * CLOCK_HZ * ISSUE_PER_SM_CLOCK / per_byte / 1e9 if body else None,
                   opcodes=dict(ops.most_common()), loads=dict(loads.most_common()))


def _gemv_cases(quick: bool) -> Iterator[tuple[str, Callable[[], LoopFigures]]]:
    from kernels.w4a16_gemm import (GEMV_KERNELS, _w4a16_gemv_kernel, _w4a16_gemv_words_kernel, gemv_tile,
                                    quantize_int4_ref, w4a16_gemm)

    n, k = (4096, 4096)
    for group in (128, 32):
        for form in GEMV_KERNELS:
            def figures(form: str = form, group: int = group) -> LoopFigures:
                q, s, z = quantize_int4_ref(torch.randn(n, k) * 0.02, group)
                kernel = _w4a16_gemv_kernel if form == "bytes" else _w4a16_gemv_words_kernel
                with captured_launch(kernel) as launches:
                    w4a16_gemm(torch.randn(1, k, dtype=torch.bfloat16), q, s, z, group, kernel=form)
                tile = gemv_tile(1, n, k, group, torch.device("cpu"))
                per_thread = tile.block_n * tile.block_b / (32 * tile.num_warps)
                return LoopFigures.of(f"w4a16 GEMV {form} g{group}", compile_sass(kernel, launches[0]), per_thread)

            yield f"w4a16_gemv.{form}.g{group}", figures
        if quick:
            return


def _attention_cases(quick: bool) -> Iterator[tuple[str, Callable[[], LoopFigures]]]:
    from kernels.paged_attention import FP8_TILE, _paged_decode_split_kernel, paged_decode_attention

    batch, heads, kv_heads, dim, page, pages = 2, 32, 8, 128, 16, 8
    for fmt in (("fp8_e4m3", "fp8_e4m3.v_pairs") if quick else ("bf16", "fp8_e4m3", "fp8_e4m3.v_pairs")):
        def figures(fmt: str = fmt) -> LoopFigures:
            fp8, v_pairs = fmt.startswith("fp8_e4m3"), fmt.endswith("v_pairs")
            dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
            cache = [torch.zeros(batch * pages, page, kv_heads, dim).to(dtype) for _ in range(2)]
            scales = [torch.zeros(batch * pages, page, kv_heads, dtype=torch.int8) for _ in range(2)] if fp8 \
                else [None, None]
            table = torch.arange(batch * pages, dtype=torch.int32).view(batch, pages)
            lens = torch.full((batch,), page * pages, dtype=torch.int32)
            q = torch.randn(batch, heads, dim, dtype=torch.bfloat16)
            with captured_launch(_paged_decode_split_kernel) as launches:
                paged_decode_attention(q, *cache, *scales, table, lens, dim ** -0.5, num_splits=1, v_pairs=v_pairs)
            launches[0]["args"]["V_ASM"] = v_pairs  # as on a GPU (the launch here saw CPU tensors)
            block_n = launches[0]["args"]["BLOCK_N"]
            warps = launches[0]["options"].get("num_warps", 4)
            kv_bytes = block_n * 2 * (dim * cache[0].element_size() + (1 if fp8 else 0))
            return LoopFigures.of(f"paged decode attention {fmt} ({block_n} tokens a tile"
                                  + (f", FP8_TILE {FP8_TILE}" if fp8 else "") + ")",
                                  compile_sass(_paged_decode_split_kernel, launches[0]), kv_bytes / (32 * warps))

        yield f"paged_attention.{fmt}", figures


def _int4_tile_cases(quick: bool) -> Iterator[tuple[str, Callable[[], LoopFigures]]]:
    """The INT4 weight tiles that feed tensor cores: the W4A16 GEMM's tiled path (prefill) and the fused MoE's
    gate-up kernel, g = 128."""
    from kernels.fused_moe import _down_kernel, _gate_up_kernel, fused_moe
    from kernels.w4a16_gemm import _w4a16_tiled_kernel, quantize_int4_ref, w4a16_gemm

    def tiled() -> LoopFigures:
        q, s, z = quantize_int4_ref(torch.randn(4096, 4096) * 0.02, 128)
        with captured_launch(_w4a16_tiled_kernel) as launches:
            w4a16_gemm(torch.randn(64, 4096, dtype=torch.bfloat16), q, s, z, 128)
        args = launches[0]["args"]
        per_thread = args["BLOCK_N"] * args["BLOCK_K"] / 2 / (32 * launches[0]["options"].get("num_warps", 4))
        return LoopFigures.of(f"w4a16 tiled GEMM g128 (M = 64; {args['BLOCK_M']}x{args['BLOCK_N']}x"
                              f"{args['BLOCK_K']} tiles)", compile_sass(_w4a16_tiled_kernel, launches[0]), per_thread)

    def moe() -> LoopFigures:
        experts, hidden, inter, tokens, top_k = 8, 1024, 512, 32, 2
        w13 = [quantize_int4_ref(torch.randn(2 * inter, hidden) * 0.02, 128) for _ in range(experts)]
        w2 = [quantize_int4_ref(torch.randn(hidden, inter) * 0.02, 128) for _ in range(experts)]
        stack = [torch.stack([w[i] for w in ws]) for ws in (w13, w2) for i in range(3)]
        ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)]).to(torch.int32)
        with captured_launch(_gate_up_kernel) as launches, captured_launch(_down_kernel):
            fused_moe(torch.randn(tokens, hidden, dtype=torch.bfloat16), stack[0], stack[3],
                      torch.rand(tokens, top_k), ids, fmt="int4", w13_scale=stack[1], w13_zeros=stack[2],
                      w2_scale=stack[4], w2_zeros=stack[5], group_size=128)
        args = launches[0]["args"]
        per_thread = 2 * args["BLOCK_N"] * args["BLOCK_K"] / 2 / (32 * launches[0]["options"].get("num_warps", 4))
        return LoopFigures.of(f"fused MoE gate-up INT4 g128 ({args['BLOCK_M']}x{args['BLOCK_N']}x{args['BLOCK_K']}"
                              " tiles, gate and up)", compile_sass(_gate_up_kernel, launches[0]), per_thread)

    yield "w4a16_tiled.g128", tiled
    if not quick:
        yield "fused_moe_gate_up.int4.g128", moe


CASES: tuple[Callable[[bool], Iterator[tuple[str, Callable[[], LoopFigures]]]], ...] = (
    _gemv_cases, _attention_cases, _int4_tile_cases)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--only", default=None, help="cases whose name contains this (e.g. w4a16_gemv.words)")


def run(args: argparse.Namespace) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("bench sass compiles for a GPU: unset TRITON_INTERPRET")
        return 2
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default until 3.10, and the GPU image's
    rows: dict[str, LoopFigures] = {}
    for cases in CASES:
        for key, figures in cases(args.quick):
            if args.only and args.only not in key:
                continue
            print(f"compiling {key} for sm_{ARCH} ...", flush=True)
            rows[key] = figures()
    header = (f"{'kernel':<72} {'regs':>5} {'smem KB':>7} {'warps/SM':>8} {'loop instr':>10} {'B/thread':>9} "
              f"{'instr/B':>8} {'ceiling GB/s':>12}")
    print(header)
    for key, r in rows.items():
        print(f"{r['name']:<72} {r['registers']:>5} {r['shared_bytes'] / 1024:>7.1f} {r['resident_warps']:>8} "
              f"{r['loop_instructions']:>10} {r['bytes_per_thread']:>9.1f} "
              f"{r['instructions_per_byte']:>8.2f} {r['issue_ceiling_gb_s'] or 0:>12.0f}")
    headline = {f"instr_per_byte.{key}": round(r["instructions_per_byte"], 2) for key, r in rows.items()}
    write_report(args.json_path, {"arch": f"sm_{ARCH}", "sms": SMS, "clock_hz": CLOCK_HZ, "cases": rows,
                                  "headline": headline})
    return 0
