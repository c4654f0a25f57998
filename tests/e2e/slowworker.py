"""A worker whose every batch lasts at least SECONDS: ``python slowworker.py SECONDS [vlmq worker options]``.

The lease test needs a job that outlives twice the visibility timeout on any machine, and a fast
backend (the engine, a GPU) generates its 1024 tokens sooner than that. The real backend still
generates every token; afterwards the batch waits out the rest of SECONDS, as a slow model would.
"""
from __future__ import annotations

import sys
import time

from vlmq.workers import backends
from vlmq.workers.backends.base import Backend, GenOutput, GenRequest
from vlmq.workers.main import main


class SlowBackend(Backend):
    def __init__(self, inner: Backend, min_seconds: float) -> None:
        self.inner, self.min_seconds, self.model_dir = inner, min_seconds, inner.model_dir

    def generate(self, requests: list[GenRequest]) -> list[GenOutput | Exception]:
        t0 = time.monotonic()
        outputs = self.inner.generate(requests)
        time.sleep(max(0.0, self.min_seconds - (time.monotonic() - t0)))
        return outputs


if __name__ == "__main__":
    min_seconds, load = float(sys.argv[1]), backends.load_backend
    # run_worker imports load_backend when it starts, so it picks this one up
    backends.load_backend = lambda *args, **kwargs: SlowBackend(load(*args, **kwargs), min_seconds)
    sys.exit(main(sys.argv[2:]))
