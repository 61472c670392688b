# make serve: set up .venv if missing, install the runtime, pull the default model, run the local cluster.
# make test:  set up .venv if missing, install the runtime and the test extras, run the whole suite.
#
# PyTorch: the install asks for torch==2.13.0 first, so no other package can pull a different build.
# Which build that is depends on where pip looks:
#   make serve                                                  # pip's configured index (here: a CPU build on disk)
#   make serve TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu     # CPU-only machine, no CUDA download
#   make serve TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128   # NVIDIA GPU: the index for your CUDA
#                                                                       # (then `edgeserve serve --device cuda`)
# PyPI's own Linux x86_64 wheel is the CUDA build (several GB); the CPU index has the small one.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
PIP     := $(BIN)/pip --disable-pip-version-check
TORCH   ?= torch==2.13.0
TORCH_INDEX_URL ?=
HASH    := $(shell cat pyproject.toml | cksum | cut -d' ' -f1)
RUNTIME := $(VENV)/.runtime-$(HASH)
TESTS   := $(VENV)/.tests-$(HASH)

# keep freed tensor memory in the heap, in transparent huge pages (see ops/cli.py: ALLOCATOR_TUNABLES)
MALLOC_KEEP := glibc.malloc.mmap_threshold=4294967296:glibc.malloc.trim_threshold=4294967296
export GLIBC_TUNABLES ?= $(MALLOC_KEEP):glibc.malloc.hugetlb=1

.PHONY: serve test install bench ibverbs

$(BIN)/python:
	@echo "edgeserve: creating $(VENV) with $(PY)"
	$(PY) -m venv $(VENV)
	@$(PIP) install --quiet --upgrade pip

$(RUNTIME): $(BIN)/python pyproject.toml
	@echo "edgeserve: installing PyTorch ($(TORCH)$(if $(TORCH_INDEX_URL), from $(TORCH_INDEX_URL)))"
	@$(PIP) install --quiet $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL)) '$(TORCH)'
	@echo "edgeserve: installing edgeserve and its runtime dependencies (starlette, uvicorn, redis, triton, ...)"
	@$(PIP) install --quiet -e .
	@$(MAKE) --no-print-directory ibverbs
	@touch $(RUNTIME)

$(TESTS): $(RUNTIME)
	@echo "edgeserve: installing the test extras (pytest, hypothesis, transformers, openai, ...)"
	@$(PIP) install --quiet -e '.[test]'
	@touch $(TESTS)

# Mooncake's native library (KV transfer, KV store tier) loads libibverbs.so.1 even with no RDMA device
ibverbs:
	@if ! /sbin/ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1 '; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "edgeserve: installing Debian's libibverbs1 (Mooncake KV transfer needs it)"; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q libibverbs1 >/dev/null || \
	      (apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q libibverbs1 >/dev/null); \
	  else \
	    echo "edgeserve: libibverbs1 is missing: run 'sudo apt-get install libibverbs1' for --kv-transport mooncake" \
	         "and --kv-store (their tests are skipped with this reason until then)"; \
	  fi; \
	fi

install: $(RUNTIME)

serve: $(RUNTIME)
	$(BIN)/edgeserve up

# the suite in one worker per CPU (pytest-xdist), at most 4 (each worker runs torch on every core, and some tests
# load a model); a test file stays in one worker, so its module fixtures are built once. PYTEST_WORKERS=0: one process.
PYTEST_WORKERS ?= logical
test: $(TESTS)
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --maxprocesses 4 --dist loadfile

# make bench: every benchmark's --quick run, one after another, then one summary table
# (bench-results/all.md and .json; each benchmark's report and log in bench-results/all/).
# BENCH_ARGS passes options on, e.g. make bench BENCH_ARGS="--only engine,integrity".
BENCH_ARGS ?=
bench: $(TESTS)
	$(BIN)/python -m ops.bench.all $(BENCH_ARGS)
