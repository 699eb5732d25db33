# GPU verifier image: CUDA torch + transformers (torch engine) and Ray (pool head, workers, gRPC front).
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
RUN apt-get update && apt-get install -y --no-install-recommends python3.11 python3.11-venv python3-pip \
        build-essential cmake git \
    && rm -rf /var/lib/apt/lists/* && python3.11 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /app
COPY pyproject.toml README.md ./
COPY edge edge
COPY cloud cloud
COPY protos protos
COPY orchestrator orchestrator
COPY bench bench
# the CUDA build of torch 2.13.0 (the default index serves it), then Tandem with its torch and pool extras
RUN pip install --no-cache-dir torch==2.13.0 && pip install --no-cache-dir '.[torch,pool]'
ENV TANDEM_CACHE=/models
VOLUME /models
EXPOSE 50051 9090
CMD ["tandem", "serve", "--engine", "torch"]
