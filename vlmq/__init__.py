"""vlmq: serve vision-language models as a worker pool behind a message queue.

The SDK (this package) never imports torch; the GPU side lives in ``vlmq.workers``.
"""
from vlmq.errors import BackendError, InvalidRequest, JobFailed, JobNotFound, JobTimeout, QueueFull, VlmqError

__version__ = "0.1.0"

__all__ = [
    "BackendError", "InvalidRequest", "JobFailed", "JobNotFound", "JobTimeout", "QueueFull", "VlmqError",
]
