#!/usr/bin/env bash
# The one prepared GPU check (fits a single ~8-minute run on a lent H200):
#   1. the CUDA variants of the kernel tests, compiled for the device (no interpreter),
#      the fused MoE's larger shapes in every weight format among them, and the MLA latent
#      store and decode kernels (byte-exact stores; decode at Kimi/DeepSeek shape, R 512, Dr 64);
#   2. the kernel microbenchmark: paged decode attention, FP8 vs BF16 pages; the fused
#      MoE per expert format (bf16, fp8, int4) against the torch path (a bf16 expert loop);
#   3. MLA decode timing: the Triton kernel over bf16 and fp8_e4m3 latent pages against
#      the torch reference (without a device this step times the reference on the CPU).
# Results go to $OUT (or bench-results/): pytest.log, bench_kernels.json, bench_mla_decode.json.
# Usage: ops/gpu_check.sh   (PY=... to choose the interpreter)
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-python3}
[ -x .venv/bin/python ] && .venv/bin/python -c "import torch; assert torch.cuda.is_available()" 2>/dev/null \
    && PY=.venv/bin/python
OUT=${OUT:-bench-results}
mkdir -p "$OUT"
export TRITON_INTERPRET=0  # the test modules default it to 1 otherwise

if ! "$PY" -c "import torch, triton, pytest" 2>/dev/null; then
    "$PY" -m pip install --quiet -e '.[test]' || { echo "cannot install the test extras"; exit 1; }
fi
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
'cuda', torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'NO DEVICE')"

status=0
timeout 300 "$PY" -m pytest -m cuda tests/kernels -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

timeout 200 "$PY" -m ops.bench_kernels --json "$OUT/bench_kernels.json" || status=1

timeout 100 "$PY" -m ops.bench_kernels --parts mla --json "$OUT/bench_mla_decode.json" || status=1
exit $status
