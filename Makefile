# Two commands for a fresh machine:  `make run` (demo chat through edge -> gRPC -> cloud)  and  `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
CACHE   ?= $(or $(TANDEM_CACHE),$(HOME)/.cache/tandem)
LLAMA   := llama-cpp-python==0.3.36
# portable build flags (runtime CPU-variant dispatch, never -march=native); the wheel cache is keyed by them
LLAMA_ARGS_FILE := deploy/llama-cpp.cmake-args
LLAMA_ARGS := $(shell grep -v '^\#' $(LLAMA_ARGS_FILE) | xargs)
LLAMA_KEY  := $(shell printf '%s %s' '$(LLAMA)' '$(LLAMA_ARGS)' | sha256sum | cut -c1-12)
WHEELS  := $(CACHE)/wheels/$(LLAMA_KEY)
STAMP   := $(VENV)/.installed

.PHONY: run test install protos bench clean

run: $(STAMP)
	$(BIN)/tandem demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python -m bench.speculative --limit 8

install: $(STAMP)

# llama-cpp-python compiles llama.cpp, once per CPU instruction-set level (~25 min on 2 cores): build its wheel
# once into the cache, reuse it after. The same wheel runs on any x86-64 CPU.
$(STAMP): pyproject.toml $(LLAMA_ARGS_FILE)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	mkdir -p $(WHEELS)
	ls $(WHEELS)/llama_cpp_python-0.3.36-*.whl >/dev/null 2>&1 || { \
		echo "building $(LLAMA) (portable: $(LLAMA_ARGS)); once, cached in $(WHEELS)"; \
		CMAKE_ARGS="$(LLAMA_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
			$(BIN)/pip wheel --no-deps -w $(WHEELS) $(LLAMA); }
	$(BIN)/pip install -q --no-deps --force-reinstall $(WHEELS)/llama_cpp_python-0.3.36-*.whl
	$(BIN)/pip install -q --find-links $(WHEELS) -e '.[test]'
	touch $(STAMP)

# The proto is the only definition of wire types; stubs are regenerated from it (tests/test_protos.py checks drift).
protos: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. protos/verifier.proto

clean:
	rm -rf $(VENV) .pytest_cache
