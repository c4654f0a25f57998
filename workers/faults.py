"""The one place that tells an infrastructure error from a job's own fault.

An infrastructure error (Redis or the object store unreachable, a timeout, a server that is loading, busy
or failing over) says nothing about the job: the worker hands the message back for redelivery, never acks
it and never marks the job failed, and the attempt does not count against ``VLMQ_MAX_ATTEMPTS``. Anything
else raised while serving a job is the job's (or the model's) and fails that job alone.
"""
from __future__ import annotations

from collections.abc import Iterator

import redis as redis_lib

from vlmq.errors import BackendError, HandBack

# first word of a Redis error reply that a later retry can get past (restart, failover, a slow script)
TRANSIENT_REPLIES = frozenset({"BUSY", "LOADING", "MASTERDOWN", "READONLY", "TRYAGAIN", "CLUSTERDOWN",
                               "NOREPLICAS", "OOM", "UNBLOCKED"})

REPLY_CLASSES = ("ReadOnlyError", "OutOfMemoryError", "MasterDownError", "TryAgainError", "ClusterDownError")


def _causes(error: BaseException) -> Iterator[BaseException]:
    """``error`` and what it was explicitly raised from (``raise ... from``), never what it merely happened
    during: a job's fault raised while handling a connection error stays the job's."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__


def _infra_types() -> tuple[type[BaseException], ...]:
    types: list[type[BaseException]] = [HandBack, BackendError, redis_lib.ConnectionError, redis_lib.TimeoutError,
                                        ConnectionError, TimeoutError]
    # redis-py strips the prefix of the replies it knows (LOADING is a ConnectionError already)
    types += [getattr(redis_lib.exceptions, name) for name in REPLY_CLASSES if hasattr(redis_lib.exceptions, name)]
    try:
        from botocore import exceptions as boto

        types += [boto.HTTPClientError, boto.ConnectionError, boto.ResponseStreamingError]
    except ImportError:  # a worker without boto3 has no S3 store
        pass
    try:
        from kombu.exceptions import OperationalError

        types.append(OperationalError)
    except ImportError:
        pass
    return tuple(types)


_INFRA = _infra_types()


def is_transient_reply(error: BaseException) -> bool:
    """A Redis error reply a retry can get past (``LOADING``, ``BUSY``, ``READONLY`` after a failover, ...)."""
    if not isinstance(error, redis_lib.ResponseError):
        return False
    words = str(error).split(None, 1)
    return bool(words) and words[0].upper() in TRANSIENT_REPLIES


def is_infra(error: BaseException) -> bool:
    """Whether ``error`` (or what it was raised from) is the infrastructure's, not the job's."""
    return any(isinstance(e, _INFRA) or is_transient_reply(e) for e in _causes(error))
