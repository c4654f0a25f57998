"""Model backends a worker can run: ``engine`` (the default) and ``hf`` (plain transformers generate, the reference)."""
from __future__ import annotations

from typing import Any

from vlmq.workers.backends.base import Backend, GenOutput, GenRequest

__all__ = ["Backend", "GenOutput", "GenRequest", "load_backend"]


def load_backend(name: str, model_dir: str, device: str, *, kv_tokens: int | None = None,
                 kv_store: Any = None, speculative: str | None = None) -> Backend:
    """Load a backend by name; ``kv_tokens``: tokens held at once (the worker's budget), for the engine's KV cache;
    ``kv_store``: the engine's KV tiers and archive (a ``vlmq.workers.kvstore.KVStore``); ``speculative``: the
    engine's proposer (Engine.from_model_dir: a method, "model" for the model folder's default, None for none)."""
    if name == "engine":
        from vlmq.workers.backends.engine import EngineBackend

        return EngineBackend(model_dir, device, kv_tokens=kv_tokens, kv_store=kv_store, speculative=speculative)
    if name == "hf":
        from vlmq.workers.backends.hf import HFBackend

        return HFBackend(model_dir, device)
    raise ValueError(f"unknown backend {name!r}; available: engine, hf")
