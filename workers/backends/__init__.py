"""Model backends a worker can run: ``hf`` (plain transformers generate, the reference) and ``engine``."""
from __future__ import annotations

from vlmq.workers.backends.base import Backend, GenOutput, GenRequest

__all__ = ["Backend", "GenOutput", "GenRequest", "load_backend"]


def load_backend(name: str, model_dir: str, device: str) -> Backend:
    """Load a backend by name."""
    if name == "hf":
        from vlmq.workers.backends.hf import HFBackend

        return HFBackend(model_dir, device)
    if name == "engine":
        from vlmq.workers.backends.engine import EngineBackend

        return EngineBackend(model_dir, device)
    raise ValueError(f"unknown backend {name!r}; available: hf, engine")
