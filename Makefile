# Two commands for a fresh machine:  `make run` (demo chat through edge -> gRPC -> cloud)  and  `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
CACHE   ?= $(or $(TANDEM_CACHE),$(HOME)/.cache/tandem)
LLAMA   := llama-cpp-python==0.3.36
UV      := uv==0.13.9
# portable build flags (runtime CPU-variant dispatch, never -march=native); the wheel cache is keyed by them
LLAMA_ARGS_FILE := deploy/llama-cpp.cmake-args
LLAMA_ARGS := $(shell grep -v '^\#' $(LLAMA_ARGS_FILE) | xargs)
LLAMA_KEY  := $(shell printf '%s %s' '$(LLAMA)' '$(LLAMA_ARGS)' | sha256sum | cut -c1-12)
WHEELS  := $(CACHE)/wheels/$(LLAMA_KEY)
# what `make run` installs: the demo's verifier (server), its drafter (edge, onnx: the default drafter drafts on
# ONNX Runtime, exported without torch); `make test` adds the rest (torch, Ray, OpenTelemetry, pytest, Playwright,
# mypy ...). Three stamps, each on the one before: `make run` then `make test` adds only the rest.
RUN_EXTRAS := edge,onnx,server
BASE    := $(VENV)/.base
RUN_STAMP := $(VENV)/.installed-run
STAMP   := $(VENV)/.installed

.PHONY: run test test-fast install protos bench lock clean chromium web dist llama-wheels

run: $(RUN_STAMP)
	$(BIN)/tandem demo

# every test's time lands in build/test-reports/junit.xml (and the slowest 30 in the log): what keeps the suite fast
test: $(STAMP) chromium web
	$(BIN)/python -m pytest -q --durations=30 --junitxml=build/test-reports/junit.xml

# the inner loop: no real models, no Ray, no browser, no statistical runs (tests/conftest.py marks them)
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not models and not ray and not browser and not slow" --junitxml=build/test-reports/junit-fast.xml

# the TypeScript client (clients/web): its packages, exactly as package-lock.json pins them, for its Node tests
web: clients/web/node_modules/.installed

# (onnxruntime-node bundles its CPU binaries; left to itself its install script fetches CUDA ones from NuGet)
clients/web/node_modules/.installed: clients/web/package-lock.json
	cd clients/web && ONNXRUNTIME_NODE_INSTALL=skip npm ci --no-audit --no-fund --loglevel=error
	touch $@

# the web chat page's test drives a real browser: Debian's chromium, installed when missing and this is root
chromium:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
		&& apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
		|| echo "chromium is not installed: tests/test_chat_page.py will fail (install Debian's chromium)"

bench: $(STAMP)
	$(BIN)/python -m bench.speculative --limit 8

install: $(STAMP)

# llama-cpp-python compiles llama.cpp, once per CPU instruction-set level (~25 min on 2 cores): build its wheel
# once into the cache, reuse it after. The same wheel runs on any x86-64 CPU. Every other version comes from
# uv.lock (exported as pip constraints, so that this machine's CPU build of torch satisfies the torch pin).
$(BASE): pyproject.toml uv.lock $(LLAMA_ARGS_FILE)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip $(UV)
	mkdir -p $(WHEELS)
	ls $(WHEELS)/llama_cpp_python-0.3.36-*.whl >/dev/null 2>&1 || { \
		echo "building $(LLAMA) (portable: $(LLAMA_ARGS)); once, cached in $(WHEELS)"; \
		CMAKE_ARGS="$(LLAMA_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
			$(BIN)/pip wheel --no-deps -w $(WHEELS) $(LLAMA); }
	$(BIN)/uv export -q --frozen --no-hashes --no-emit-project --all-extras -o $(VENV)/constraints.txt
	$(BIN)/pip install -q --no-deps --force-reinstall $(WHEELS)/llama_cpp_python-0.3.36-*.whl
	touch $@

$(BIN)/uv:
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip $(UV)

# the demo's packages only (no torch, Ray, Playwright or mypy)
$(RUN_STAMP): $(BASE)
	$(BIN)/pip install -q -c $(VENV)/constraints.txt --find-links $(WHEELS) -e '.[$(RUN_EXTRAS)]'
	touch $@

# everything else the suite needs
$(STAMP): $(RUN_STAMP)
	$(BIN)/pip install -q -c $(VENV)/constraints.txt --find-links $(WHEELS) -e '.[test]'
	touch $@

# the Python package as a wheel and an sdist in $(DIST) (the wheel built from the sdist, so the sdist is complete);
# the build backend comes from PyPI into uv's cache, nothing is installed. tests/test_dist.py installs the wheel.
DIST    ?= dist
dist: $(BIN)/uv
	rm -rf $(DIST)/tandem-*.whl $(DIST)/tandem-*.tar.gz tandem.egg-info  # (an old file list would go in the sdist)
	$(BIN)/uv build -q --out-dir $(DIST)

# the folder of llama-cpp-python's cached wheel, for installing the wheel elsewhere: pip install --find-links DIR
llama-wheels:
	@echo $(WHEELS)

# after changing dependencies in pyproject.toml: re-resolve the lock (keeps every version it can), then commit it
lock: $(BIN)/uv
	$(BIN)/uv lock

# The proto is the only definition of wire types; stubs are regenerated from it (tests/test_protos.py checks drift).
protos: $(STAMP)
	$(BIN)/python -m tandem.protos.generate

clean:
	rm -rf $(VENV) .pytest_cache clients/web/node_modules clients/web/dist dist build
