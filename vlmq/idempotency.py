"""Idempotency keys: a key names a job only once that job's record exists.

A submit claims each key with a pending value (``~<job id> <fingerprint>``, ``SET NX GET``) that lives
``PENDING_TTL`` s beyond the caller's ``wait_for_room``; the enqueue script (``vlmq.affinity.ENQUEUE_SCRIPT``)
replaces it with ``<job id> <fingerprint>`` in the same atomic step that writes the job's record and message. A
second submit with the same key and request waits while the key is pending, then gets the published job id, or
claims the key itself if the first submit failed and released it. Release is compare-and-delete
(``vlmq.functions.RELEASE``): a key already published, or taken over after its pending value lapsed, is kept.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from vlmq import functions, keys
from vlmq.errors import BackendError, InvalidRequest

log = logging.getLogger(__name__)
PENDING_TTL = 300  # seconds an idempotency key stays pending (its job being enqueued) beyond wait_for_room
POLL = 0.05  # seconds between looks at a key another submit holds pending


def pending(job_id: str, fingerprint: str) -> str:
    """What an idempotency key holds while its job is being enqueued: ``~<job id> <fingerprint>``."""
    return f"~{job_id} {fingerprint}"


def check_same(key: str, first: tuple[str, str], fingerprint: str) -> None:
    """Raise ``InvalidRequest`` (``idempotency_conflict``) unless ``first`` (job id, fingerprint) is this request."""
    if first[1] != fingerprint:
        raise InvalidRequest(f"idempotency key {key!r} was used for a different request (job {first[0]}); "
                             "the same key must come with the same image, prompt and parameters",
                             code="idempotency_conflict")


def claim(store: Any, key: str, job_id: str, fingerprint: str, ttl: float) -> tuple[str, str] | None:
    """Bind ``key`` to this job, pending, for ``ttl`` s; returns the first job and request if one was published.

    Args:
        store: the client's ``vlmq.store.JobStore`` (its tenant names the key).

    Raises:
        InvalidRequest: ``idempotency_conflict``, the key is bound to a different request.
        BackendError: another submit held the key pending for longer than ``ttl`` s.
    """
    name, deadline = keys.idempotency(key, store.tenant), time.monotonic() + ttl
    while True:
        # one atomic step that either claims the key or returns what it holds
        stored: bytes | None = store.call(store.redis.set, name, pending(job_id, fingerprint), nx=True, get=True,
                                          ex=max(1, int(ttl)))
        if stored is None:
            return None
        text = stored.decode(errors="replace")
        first_id, _, first_fingerprint = text.removeprefix("~").partition(" ")
        check_same(key, (first_id, first_fingerprint), fingerprint)
        if not text.startswith("~"):
            return first_id, first_fingerprint
        if time.monotonic() >= deadline:
            raise BackendError(f"idempotency key {key!r} is held by another submit (job {first_id}) that has not "
                               f"enqueued its job after {ttl:.0f} s; retry later")
        time.sleep(POLL)  # its job is being enqueued: published once its record exists, or released


def release(store: Any, claimed: Sequence[tuple[str, str]]) -> None:
    """Delete each ``(key, pending value)`` this submit claimed, where the key still holds that value.

    Best effort (a submit that failed is raising its own error): a key left pending lapses after its TTL.
    """
    try:
        store.call(functions.call_many, store.redis,
                   [("release", [keys.idempotency(key, store.tenant)], [value]) for key, value in claimed])
    except BackendError as e:
        log.warning("could not release idempotency keys %s (they lapse on their own): %s",
                    [key for key, _ in claimed][:5], e)
