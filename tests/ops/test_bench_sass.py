"""`edgeserve bench sass --quick`: the GPU kernels compiled for sm_90 on this machine (no GPU), their hot loops
found and counted. Runs in a child process: the suite interprets Triton kernels, this compiles them."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ops.bench.sass import ISSUE_PER_SM_CLOCK, hot_loop, resident_warps


def test_hot_loop_is_the_largest_backward_branch() -> None:
    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   FFMA R2, R3, R4, R5 ;
        /*0020*/              @!P0 BRA 0x10 ;
        /*0030*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0040*/                   LOP3.LUT R6, R4, 0xf, RZ, 0xc0, !PT ;
        /*0050*/                   FADD R7, R6, -8 ;
        /*0060*/               @P1 BRA 0x30 ;
        /*0070*/                   BRA 0x90 ;
        /*0080*/                   EXIT ;
    """
    assert hot_loop(sass) == [("LDG", ".E.128"), ("LOP3", ".LUT"), ("FADD", ""), ("BRA", "")]


def test_resident_warps_takes_the_scarcest_resource() -> None:
    assert resident_warps(255, 41472, 4) == 8  # registers: 8192 a warp (255 rounded up), two blocks of four warps
    assert resident_warps(96, 1024, 4) == 20  # registers: 3072 a warp, five blocks
    assert resident_warps(32, 120_000, 4) == 4  # shared memory: one block
    assert resident_warps(16, 0, 1) == 32  # blocks: at most 32
    assert resident_warps(16, 0, 32) == 64  # warps: at most 64


@pytest.mark.skipif(sys.platform != "linux" or os.uname().machine != "x86_64",
                    reason="the triton wheel's ptxas and cuobjdump are x86-64 Linux binaries")
def test_bench_sass_quick(tmp_path: Path) -> None:
    out = tmp_path / "sass.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run([sys.executable, "-m", "ops.cli", "bench", "sass", "--quick", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=600, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    cases = report["cases"]
    assert set(cases) == {"w4a16_gemv.bytes.g128", "w4a16_gemv.words.g128", "w4a16_gemv.words-prefetch.g128",
                          "paged_attention.fp8_e4m3", "paged_attention.fp8_e4m3.v_pairs", "w4a16_tiled.g128"}
    for key, case in cases.items():
        assert 0 < case["registers"] <= 255, key
        assert 0 < case["resident_warps"] <= 64 and case["resident_warps"] % case["warps"] == 0, key
        assert case["loop_instructions"] == sum(case["opcodes"].values()) > 50, key
        assert case["instructions_per_byte"] == pytest.approx(case["loop_instructions"] / case["bytes_per_thread"])
        assert math.isclose(case["issue_ceiling_gb_s"], report["sms"] * report["clock_hz"] * ISSUE_PER_SM_CLOCK
                            / case["instructions_per_byte"] / 1e9)
    # the words forms read their codes 16 bytes a load (a thread's 64 bytes of a tile in four), not byte by byte
    for form in ("words", "words-prefetch"):
        loads = cases[f"w4a16_gemv.{form}.g128"]["loads"]
        assert loads.get("LDG.E.128", 0) >= 4 and "LDG.E.U8" not in loads, loads
    # FP8 V in pairs: no shared-memory load of one byte (the plain form made 128 a thread a tile)
    assert "LDS.U8" not in cases["paged_attention.fp8_e4m3.v_pairs"]["loads"]
    # INT4 tiles for tensor cores: bytes in vectors (cp.async), none a byte at a time, no register spills
    tiled = cases["w4a16_tiled.g128"]
    assert "LDG.E.U8" not in tiled["loads"] and "LDL" not in tiled["opcodes"], tiled
    assert report["provenance"]["command"].startswith("edgeserve bench sass")
