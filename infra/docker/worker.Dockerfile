# syntax=docker/dockerfile:1
# The GPU worker image: CUDA base, torch from its own index, then vlmq[worker,gpu].
#   docker build -f infra/docker/worker.Dockerfile -t ghcr.io/vlmq/vlmq-worker:0.1.0 .
# CPU build of the same image (the compose cpu profile, the k8s cpu overlay):
#   docker build -f infra/docker/worker.Dockerfile -t ghcr.io/vlmq/vlmq-worker:0.1.0-cpu \
#     --build-arg BUILD_IMAGE=ubuntu:24.04 --build-arg RUNTIME_IMAGE=ubuntu:24.04 \
#     --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu --build-arg EXTRAS=worker .
ARG BUILD_IMAGE=nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04
ARG RUNTIME_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

FROM ${BUILD_IMAGE} AS build
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ARG TORCH_VERSION=2.13.0
ARG EXTRAS=worker,gpu
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/vlmq
ENV PATH=/opt/vlmq/bin:$PATH
# torch first, from its own index (PyPI's default wheel is not the CUDA build we pin)
RUN pip install --no-cache-dir --index-url ${TORCH_INDEX} torch==${TORCH_VERSION}
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY vlmq vlmq
COPY workers workers
COPY kernels kernels
# flash-attn (the gpu extra) compiles against the installed torch, so no build isolation
RUN pip install --no-cache-dir --no-build-isolation ".[${EXTRAS}]"

FROM ${RUNTIME_IMAGE}
RUN apt-get update && apt-get install -y --no-install-recommends python3 tini \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/vlmq /opt/vlmq
ENV PATH=/opt/vlmq/bin:$PATH PYTHONUNBUFFERED=1 VLMQ_METRICS_PORT=9464 VLMQ_WORKER_EVENTS=1
RUN useradd --uid 10001 --create-home vlmq
USER 10001
EXPOSE 9464
# tini (PID 1) forwards SIGTERM to vlmq, which stops taking work and lets running jobs finish
ENTRYPOINT ["tini", "--", "vlmq"]
CMD ["worker", "--gpus", "all"]
