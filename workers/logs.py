"""Worker logs: plain text, or one JSON object per line (``--log-format json``) carrying the job's context.

The job runner sets the context (job id, model, cost class) around each job with ``job_context``; a log line
names its phase with ``extra=phase("finished")``. Lines logged outside a job carry the worker only.
"""
from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from contextvars import ContextVar

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_JOB: ContextVar[dict[str, str] | None] = ContextVar("vlmq_job", default=None)


@contextlib.contextmanager
def job_context(job_id: str, model: str, cost_class: str) -> Iterator[None]:
    """Every line logged in this block (in this thread) names the job."""
    token = _JOB.set({"job_id": job_id, "model": model, "class": cost_class})
    try:
        yield
    finally:
        _JOB.reset(token)


def phase(name: str) -> dict[str, str]:
    """``extra=`` of a line marking a job's transition (started, finished, failed, canceled, handed_back, ...)."""
    return {"phase": name}


class JsonFormatter(logging.Formatter):
    def __init__(self, worker: str) -> None:
        super().__init__()
        self.worker = worker

    def format(self, record: logging.LogRecord) -> str:
        doc = {"ts": round(record.created, 3), "level": record.levelname, "logger": record.name,
               "worker": self.worker, **(_JOB.get() or {})}
        if hasattr(record, "phase"):
            doc["phase"] = record.phase
        doc["message"] = record.getMessage()
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc)


def configure(log_format: str, worker: str) -> None:
    """Root logging at INFO on stderr, as text or JSON lines."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter(worker) if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)  # Python warnings become log lines too (JSON ones with --log-format json)
