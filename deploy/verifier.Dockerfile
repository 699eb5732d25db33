# GPU verifier image: CUDA torch + transformers (torch engine) and Ray (pool head, workers, gRPC front).
# Ubuntu 24.04 ships Python 3.12 (python3); llama.cpp (a base dependency) is built portable, never for the build
# machine's CPU (deploy/llama-cpp.cmake-args).
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 AS build
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-pip \
        build-essential cmake git \
    && rm -rf /var/lib/apt/lists/* && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY deploy/llama-cpp.cmake-args /tmp/llama-cpp.cmake-args
RUN CMAKE_ARGS="$(grep -v '^#' /tmp/llama-cpp.cmake-args | xargs)" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    pip wheel --no-cache-dir --no-deps -w /wheels llama-cpp-python==0.3.36
# every other version from uv.lock, as pip constraints (the versions the suite ran with)
COPY pyproject.toml uv.lock /src/
RUN pip install --no-cache-dir uv==0.13.9 \
    && cd /src && uv export --frozen --no-hashes --no-emit-project --extra server --extra torch --extra pool --extra otel -o /wheels/constraints.txt

FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv libgomp1 \
    && rm -rf /var/lib/apt/lists/* && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY --from=build /wheels /wheels
WORKDIR /app
COPY pyproject.toml README.md ./
COPY core core
COPY edge edge
COPY cloud cloud
COPY protos protos
COPY orchestrator orchestrator
# the CUDA build of torch 2.13.0 (the default index serves it), then Tandem with its server, torch, pool and otel
# extras at uv.lock's versions
RUN pip install --no-cache-dir /wheels/llama_cpp_python-*.whl torch==2.13.0 \
    && pip install --no-cache-dir -c /wheels/constraints.txt --find-links /wheels '.[server,torch,pool,otel]'
# an unprivileged user owns the model cache; nothing else is writable for it
RUN useradd --uid 10001 --create-home tandem && mkdir -p /models && chown tandem /models
USER 10001
ENV TANDEM_CACHE=/models
VOLUME /models
EXPOSE 50051 9090
CMD ["tandem", "serve", "--engine", "torch"]
