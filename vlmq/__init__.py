"""vlmq: serve vision-language models as a worker pool behind a message queue.

``from vlmq import Client, Job, JobStatus, JobRequest`` is the SDK's front door. The SDK never imports
torch; the GPU side lives in ``vlmq.workers``. ``import vlmq`` stays cheap: the client and its
dependencies (redis, Pillow, Celery) load on first use of one of these names.
"""
from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

from vlmq.errors import BackendError, InvalidRequest, JobFailed, JobNotFound, JobTimeout, QueueFull, VlmqError

if TYPE_CHECKING:
    from vlmq.client import Client
    from vlmq.jobs import Job, JobResult
    from vlmq.request import JobRequest
    from vlmq.settings import Settings
    from vlmq.store import JobStatus

__version__ = "0.1.0"

# This folder in a checkout, imported from the checkout's root (its root first on sys.path) while vlmq is
# installed as a wheel elsewhere: vlmq.workers and vlmq.kernels are then the checkout's own folders too, as
# setup.py maps them, never a mix of two trees or an ImportError.
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isfile(os.path.join(_CHECKOUT, "setup.py")) and os.path.isfile(os.path.join(_CHECKOUT, "workers", "app.py")):
    __path__.append(_CHECKOUT)

_LAZY = {"Client": "vlmq.client", "Job": "vlmq.jobs", "JobResult": "vlmq.jobs", "JobRequest": "vlmq.request",
         "JobStatus": "vlmq.store", "Settings": "vlmq.settings"}

__all__ = [
    "BackendError", "Client", "InvalidRequest", "Job", "JobFailed", "JobNotFound", "JobRequest", "JobResult",
    "JobStatus", "JobTimeout", "QueueFull", "Settings", "VlmqError",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'vlmq' has no attribute {name!r}")
