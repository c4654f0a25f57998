"""Errors the engine raises on purpose; the worker maps them to the SDK's codes at its boundary
(backends/engine.py), so nothing here is the SDK's `InvalidRequest`."""
from __future__ import annotations

from vlmq.errors import VlmqError


class EngineError(VlmqError):
    """Base of the engine's own errors."""


class RequestRejected(EngineError):
    """This request alone can never be served by this engine (too long, bad input); other requests go on.

    ``code`` is the machine-readable reason users see (``prompt_too_long``, ``exceeds_kv_capacity``, ...).
    """

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code
