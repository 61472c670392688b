# make serve: set up .venv if missing, install, pull the default model, run the local cluster.
# make test:  set up .venv if missing, install (with test extras), run the whole suite.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

# keep freed tensor memory in the heap (see ops/cli.py: ALLOCATOR_TUNABLES)
export GLIBC_TUNABLES ?= glibc.malloc.mmap_threshold=4294967296:glibc.malloc.trim_threshold=4294967296

.PHONY: serve test install bench

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	# torch is pinned first so nothing pulls a multi-GB CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/edgeserve up

test: $(STAMP)
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/edgeserve bench engine
