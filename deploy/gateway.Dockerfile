# Gateway / edge / CPU-verifier image: llama.cpp (CPU) for drafter and verifier, FastAPI gateway.
# Runs on any x86-64 CPU: llama.cpp is built portable (deploy/llama-cpp.cmake-args), never for the build machine.
FROM python:3.11-slim AS build
RUN apt-get update && apt-get install -y --no-install-recommends build-essential cmake git \
    && rm -rf /var/lib/apt/lists/*
COPY deploy/llama-cpp.cmake-args /tmp/llama-cpp.cmake-args
RUN CMAKE_ARGS="$(grep -v '^#' /tmp/llama-cpp.cmake-args | xargs)" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    pip wheel --no-cache-dir --no-deps -w /wheels llama-cpp-python==0.3.36
# every other version from uv.lock, as pip constraints (the versions the suite ran with)
COPY pyproject.toml uv.lock /src/
RUN pip install --no-cache-dir uv==0.13.9 \
    && cd /src && uv export --frozen --no-hashes --no-emit-project --extra server --extra otel -o /wheels/constraints.txt

FROM python:3.11-slim
# libgomp: llama.cpp's CPU backend runs its threads with OpenMP; no compiler in this layer
RUN apt-get update && apt-get install -y --no-install-recommends libgomp1 && rm -rf /var/lib/apt/lists/*
COPY --from=build /wheels /wheels
WORKDIR /app
COPY pyproject.toml README.md ./
COPY core core
COPY edge edge
COPY cloud cloud
COPY protos protos
COPY orchestrator orchestrator
RUN pip install --no-cache-dir /wheels/llama_cpp_python-*.whl && pip install --no-cache-dir -c /wheels/constraints.txt --find-links /wheels '.[server,otel]'
# an unprivileged user owns the model cache; nothing else is writable for it
RUN useradd --uid 10001 --create-home tandem && mkdir -p /models && chown tandem /models
USER 10001
ENV TANDEM_CACHE=/models
VOLUME /models
EXPOSE 8000 50051
CMD ["tandem", "serve"]
