# Two commands for a fresh machine:  `make run` (demo chat through edge -> gRPC -> cloud)  and  `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
CACHE   ?= $(or $(TANDEM_CACHE),$(HOME)/.cache/tandem)
WHEELS  := $(CACHE)/wheels
LLAMA   := llama-cpp-python==0.3.36
STAMP   := $(VENV)/.installed

.PHONY: run test install protos bench clean

run: $(STAMP)
	$(BIN)/tandem demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python -m bench.speculative --limit 8

install: $(STAMP)

# llama-cpp-python compiles llama.cpp (~5 min on 2 cores): build its wheel once into the cache, reuse it after.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	mkdir -p $(WHEELS)
	ls $(WHEELS)/llama_cpp_python-0.3.36-*.whl >/dev/null 2>&1 || \
		$(BIN)/pip wheel --no-deps -w $(WHEELS) $(LLAMA)
	$(BIN)/pip install -q --find-links $(WHEELS) -e '.[test]'
	touch $(STAMP)

# The proto is the only definition of wire types; stubs are regenerated from it (tests/test_protos.py checks drift).
protos: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. protos/verifier.proto

clean:
	rm -rf $(VENV) .pytest_cache
