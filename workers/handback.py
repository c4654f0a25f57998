"""Handing a message back: its delivery's bookkeeping undone, also when Redis is what went away.

A handed-back job is queued again and its attempt is not counted against ``VLMQ_MAX_ATTEMPTS`` (it was no
crash). When the hand-back itself cannot reach Redis, the attempt is owed: a thread takes it off once Redis
answers again (the message stays in kombu's unacked hash meanwhile and is redelivered after the visibility
timeout). A worker killed while it owes one leaves the attempt counted, as for any crash.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vlmq import keys, store
from vlmq.jobs import JobStatus
from vlmq.workers import faults
from vlmq.workers.logs import phase
from vlmq.workers.native import worker_thread

if TYPE_CHECKING:
    from vlmq.workers.jobrunner import WorkerContext

log = logging.getLogger(__name__)
RETRY_S = 1.0  # seconds between tries to pay owed attempts
# KEYS[1] the job record: take one attempt off if the record still exists (never re-create an expired one)
_UNCOUNT = "if redis.call('EXISTS', KEYS[1]) == 1 then return redis.call('HINCRBY', KEYS[1], 'attempts', -1) end"


@dataclass(slots=True)
class Delivery:
    """One delivery of a job's message on this worker."""

    counted: bool = False  # its attempt is in the record's count (a hand-back takes it off)


def uncount(redis: Any, job_id: str) -> None:
    redis.eval(_UNCOUNT, 1, keys.job(job_id))


class OwedAttempts:
    """Attempts a hand-back could not take off while Redis was down; a daemon thread pays them when it is back."""

    def __init__(self, redis: Any) -> None:
        self.redis = redis
        self._owed: list[str] = []
        self._lock = threading.Lock()
        self._paying = threading.Lock()  # one payer at a time: an attempt is never taken off twice
        self._thread: threading.Thread | None = None

    def add(self, job_id: str) -> None:
        with self._lock:
            self._owed.append(job_id)
            if self._thread is None or not self._thread.is_alive():
                self._thread = worker_thread(self._run, "vlmq-owed")
                self._thread.start()

    def pending(self) -> int:
        with self._lock:
            return len(self._owed)

    def pay(self) -> int:
        """Take off what is owed; returns how many are still owed (Redis still down). An attempt stays owed (and
        counted by ``pending``) until Redis has taken it off."""
        with self._paying:
            with self._lock:
                owed = list(self._owed)
            for job_id in owed:
                try:
                    uncount(self.redis, job_id)
                except Exception as e:
                    if not faults.is_infra(e):
                        raise
                    break
                with self._lock:
                    self._owed.remove(job_id)
            return self.pending()

    def _run(self) -> None:
        while True:
            time.sleep(RETRY_S)
            try:
                if self.pay() == 0:
                    return
            except Exception:  # never let the thread die with attempts owed
                log.warning("paying owed attempts failed", exc_info=True)


def hand_back(ctx: WorkerContext, job_id: str, counted: bool = True) -> None:
    """Undo this delivery's bookkeeping: a handed-back job is queued again and was no crash. Never raises for an
    infrastructure error (the message then comes back after the visibility timeout, and the attempt is owed)."""
    try:
        if counted:
            uncount(ctx.redis, job_id)
            counted = False
        store.transition(ctx.redis, job_id, [JobStatus.STARTED], JobStatus.QUEUED)
    except Exception as e:
        if not faults.is_infra(e):
            raise
        if counted and ctx.owed is not None:
            ctx.owed.add(job_id)
        log.warning("job %s: handing back could not reach Redis (%s); its message comes back after the visibility "
                    "timeout", job_id, e, extra=phase("handed_back"))
        return
    log.info("job %s handed back to the queue", job_id, extra=phase("handed_back"))
