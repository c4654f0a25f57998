# syntax=docker/dockerfile:1
# The slim producer image: the vlmq SDK and CLI (no torch), for producers, vlmq serve and the webhook delivery worker.
#   docker build -f infra/docker/producer.Dockerfile -t ghcr.io/vlmq/vlmq:0.1.0 .
FROM python:3.12-slim
RUN apt-get update && apt-get install -y --no-install-recommends tini && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY vlmq vlmq
COPY workers workers
COPY kernels kernels
# the serve extra only (starlette, uvicorn: vlmq serve): torch and transformers stay out (vlmq never imports them)
RUN pip install --no-cache-dir ".[serve]" && rm -rf /src
RUN useradd --uid 10001 --create-home vlmq
USER 10001
WORKDIR /home/vlmq
ENTRYPOINT ["tini", "--", "vlmq"]
CMD ["--help"]
