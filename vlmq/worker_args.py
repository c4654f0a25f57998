"""Command-line options of ``vlmq worker`` and ``vlmq delivery`` (kept in the SDK so ``vlmq --help`` needs no torch)."""
from __future__ import annotations

import argparse

from vlmq.settings import BACKENDS, LOG_FORMATS


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny-shapes", help="model name (default tiny-shapes)")
    parser.add_argument("--device", help="cpu, cuda or cuda:N (VLMQ_DEVICE)")
    parser.add_argument("--gpus", help="'all' or a list like 0,1: one worker process per GPU")
    parser.add_argument("--classes", help="cost classes to consume, e.g. xs,s (VLMQ_WORKER_CLASSES)")
    parser.add_argument("--budget", type=int, help="sum of class costs held at once (VLMQ_WORKER_BUDGET)")
    parser.add_argument("--batch", type=int, help="most jobs held at once (VLMQ_WORKER_BATCH)")
    parser.add_argument("--backend", choices=BACKENDS,
                        help="engine (the vlmq engine; default) or hf (plain transformers generate) (VLMQ_BACKEND)")
    parser.add_argument("--speculative", help="speculative decoding (engine backend): ngram, draft:<path>, head or "
                        "none; default: the model folder's choice (its vlmq.json), else none (VLMQ_SPECULATIVE)")
    parser.add_argument("--name", help="worker name shown in results")
    parser.add_argument("--log-format", choices=LOG_FORMATS,
                        help="text, or json: one JSON object per line (VLMQ_LOG_FORMAT)")


def add_delivery_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--concurrency", type=int, help="requests sent at once (VLMQ_WEBHOOK_CONCURRENCY)")
    parser.add_argument("--name", help="worker name shown in logs")
