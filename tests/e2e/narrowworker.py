"""A worker whose engine runs at most N sequences at once: ``python narrowworker.py N [vlmq worker options]``.

The worker still holds ``VLMQ_WORKER_BATCH`` jobs; the engine's scheduler keeps the ones it cannot run yet
waiting, in priority order. The priority test needs that queue inside the engine: with the default limits
every job the tiny model's worker holds runs at once, so the order in the engine would not show.
"""
from __future__ import annotations

import sys

from vlmq.workers import backends
from vlmq.workers.backends.engine import EngineBackend
from vlmq.workers.main import main

if __name__ == "__main__":
    max_num_seqs = int(sys.argv[1])

    def load_narrow(name: str, model_dir: str, device: str, **options: object) -> EngineBackend:
        assert name == "engine", name  # options: what load_backend takes (kv_tokens, kv_store, speculative)
        return EngineBackend(model_dir, device, max_num_seqs=max_num_seqs, **options)  # type: ignore[arg-type]

    # run_worker imports load_backend when it starts, so it picks this one up
    backends.load_backend = load_narrow
    sys.exit(main(sys.argv[2:]))
