# Gateway / edge / CPU-verifier image: llama.cpp (CPU) for drafter and verifier, FastAPI gateway.
FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends build-essential cmake git \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY edge edge
COPY cloud cloud
COPY protos protos
COPY orchestrator orchestrator
COPY bench bench
# llama-cpp-python compiles llama.cpp for the build machine's CPU; pass CMAKE_ARGS to target another
RUN pip install --no-cache-dir .
ENV TANDEM_CACHE=/models
VOLUME /models
EXPOSE 8000 50051
CMD ["tandem", "serve"]
