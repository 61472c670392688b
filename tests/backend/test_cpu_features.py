"""`--dtype auto` / `--kv-format auto`: the host's vector units decide, as the module documents."""

import pytest

from backend.cpu_features import (auto_dtype, auto_kv_format, cpu_flags, has_amx_bf16, has_avx2_fma, has_avx512_bf16,
                                  resolve_dtype, resolve_kv_format)
from ops.serve import add_engine_args

SAPPHIRE_RAPIDS = {"avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "amx_int8"}
ZEN4 = {"avx512f", "avx512_bf16", "avx2"}
SKYLAKE = {"avx512f", "avx2", "fma"}
ZEN3 = {"avx2", "fma", "f16c"}


@pytest.mark.parametrize("flags,expected", [(SAPPHIRE_RAPIDS, "bfloat16"), (ZEN4, "bfloat16"), (SKYLAKE, "bfloat16"),
                                            (ZEN3, "bfloat16"), ({"avx2"}, "float32"),
                                            ({"amx_bf16"}, "float32"), ({"avx512_bf16"}, "bfloat16"),
                                            (set(), "float32")])
def test_auto_dtype_follows_the_cpu_flags(flags, expected):
    assert auto_dtype("cpu", flags, bf16_gemv=True) == expected
    assert auto_dtype("cuda", flags) == "bfloat16"  # the GPU's choice, whatever the host CPU


def test_a_host_without_bf16_units_takes_bfloat16_only_where_the_gemv_runs(monkeypatch: pytest.MonkeyPatch):
    """Without the C GEMV every bfloat16 linear would run torch's emulated GEMM there (AVX2 or AVX-512F alike)."""
    assert auto_dtype("cpu", ZEN3, bf16_gemv=False) == "float32"
    assert auto_dtype("cpu", SKYLAKE, bf16_gemv=False) == "float32"
    assert auto_dtype("cpu", ZEN4, bf16_gemv=False) == "bfloat16"  # real bfloat16 units: the flags decide
    monkeypatch.setenv("EDGESERVE_BF16_GEMV", "0")  # asked, not told: the switch that turns the GEMV off
    assert auto_dtype("cpu", ZEN3) == "float32"


def test_auto_kv_format_is_the_compute_dtype_own():
    assert auto_kv_format("bfloat16") == "bf16" and auto_kv_format("float32") == "fp32"
    assert resolve_kv_format("auto", "bfloat16") == "bf16"
    assert resolve_kv_format("fp8_e4m3", "bfloat16") == "fp8_e4m3"  # an explicit choice is kept


def test_resolve_reads_this_host():
    assert has_amx_bf16() == ({"amx_bf16", "amx_tile"} <= cpu_flags())
    assert has_avx512_bf16() == ("avx512_bf16" in cpu_flags())
    from kernels import cpu_gemv

    bf16 = has_amx_bf16() or has_avx512_bf16() or (has_avx2_fma() and cpu_gemv.available())
    assert resolve_dtype("auto") == ("bfloat16" if bf16 else "float32")
    assert resolve_dtype("float32") == "float32" and resolve_dtype("auto", "cuda") == "bfloat16"


def test_serve_defaults_to_auto():
    import argparse

    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args([])
    assert (args.dtype, args.kv_format) == ("auto", "auto")
    assert p.parse_args(["--dtype", "float32", "--kv-format", "fp8_e4m3"]).dtype == "float32"
