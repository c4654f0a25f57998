"""The producer's Lua scripts as one Redis Functions library: loaded once (``FUNCTION LOAD``), run with ``FCALL``.

Tenants hold ``FCALL`` and neither ``EVAL`` nor ``FUNCTION`` (``vlmq.acl``): they can run vlmq's own scripts and
no code of their own, so they can neither keep the server busy with a script nor replace what the library does.
Each function runs with its caller's ACL key permissions, as a script did.

The library's name carries a digest of its code (``vlmq_<digest>``), so loading is idempotent, never replaces
anything, and producers and workers of different versions each call their own code. Workers load it when they
start (their ACL user may); a call that finds it missing loads it when the caller may (workers, untenanted
producers) and otherwise says what to do.
"""
from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from typing import Any

import redis as redis_lib

# KEYS[1] an idempotency key; ARGV[1] the value this caller bound it to. Deletes the key only while it holds that
# value, so a caller never releases a binding that is no longer its own (vlmq.client). Returns 1 if deleted.
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


@functools.cache
def library() -> tuple[str, str]:
    """``(name, source)`` of the library: every producer script, each as ``<name>_<function>``."""
    from vlmq import affinity, store

    bodies = {"transition": store.TRANSITION, "enqueue": affinity.ENQUEUE_SCRIPT, "release": RELEASE}
    digest = hashlib.sha256(repr(sorted(bodies.items())).encode()).hexdigest()[:16]
    name = f"vlmq_{digest}"
    source = "".join(f"redis.register_function('{name}_{fn}', function(KEYS, ARGV)\n{body}\nend)\n"
                     for fn, body in bodies.items())
    return name, f"#!lua name={name}\n{source}"


def function_name(fn: str) -> str:
    """The name ``FCALL`` takes for one of the library's functions (``transition``, ``enqueue``, ``release``)."""
    return f"{library()[0]}_{fn}"


def load(redis: Any) -> None:
    """Load the library unless it is there already (never replaces one).

    Raises:
        redis.exceptions.ResponseError: these credentials may not load it (a tenant's may not).
    """
    try:
        redis.function_load(library()[1])
    except redis_lib.exceptions.NoPermissionError as e:
        raise redis_lib.exceptions.ResponseError(
            f"the vlmq function library {library()[0]} is not loaded on this server and these credentials may not "
            "load it (a tenant's may not): start a worker of this vlmq version, which loads it") from e
    except redis_lib.exceptions.ResponseError as e:
        if "already exists" not in str(e):
            raise


def missing(reply: object) -> bool:
    """Whether a reply is the server's refusal of a function it does not have."""
    return isinstance(reply, redis_lib.exceptions.ResponseError) and "function not found" in str(reply).lower()


def call(redis: Any, fn: str, keys: Sequence[Any], args: Sequence[Any]) -> Any:
    """``FCALL`` one function of the library, loading the library first if the server lacks it."""
    try:
        return redis.fcall(function_name(fn), len(keys), *keys, *args)
    except redis_lib.exceptions.ResponseError as e:
        if not missing(e):
            raise
    load(redis)
    return redis.fcall(function_name(fn), len(keys), *keys, *args)


def call_many(redis: Any, calls: Sequence[tuple[str, Sequence[Any], Sequence[Any]]]) -> list[Any]:
    """``(function, keys, args)`` calls in one pipelined round trip; the library is loaded if the server lacks it.

    A call the server refused for a missing function ran nothing, so it is sent again once the library is loaded.

    Raises:
        redis.exceptions.ResponseError: the first call that failed otherwise.
    """
    replies = _pipelined(redis, calls)
    again = [i for i, reply in enumerate(replies) if missing(reply)]
    if again:
        load(redis)
        for i, reply in zip(again, _pipelined(redis, [calls[i] for i in again]), strict=True):
            replies[i] = reply
    for reply in replies:
        if isinstance(reply, redis_lib.exceptions.ResponseError):
            raise reply
    return replies


def _pipelined(redis: Any, calls: Sequence[tuple[str, Sequence[Any], Sequence[Any]]]) -> list[Any]:
    pipe = redis.pipeline(transaction=False)
    for fn, keys, args in calls:
        pipe.fcall(function_name(fn), len(keys), *keys, *args)
    return list(pipe.execute(raise_on_error=False))
