"""Object-store retention: inputs and results older than ``VLMQ_RETENTION`` are deleted by the workers.

No bucket lifecycle rule is needed (``file://`` stores and S3-compatible servers without them work the
same). Every worker runs a sweeper thread; a Redis ``SET NX EX`` lock (``keys.retention_lock``) that
expires after one period lets at most one worker sweep per period across the fleet.

Inputs are content-addressed, so an old input object may serve a job submitted a minute ago (the SDK
skips the upload when the object exists). The sweep lists old objects first, then reads every job
record and keeps the inputs named by queued or started jobs: a job never loses its input while it
waits or runs. What is left is a narrow race: a submit that found the old object and writes its record
during one sweep's few seconds between reading the records and deleting; that job fails with
``input_missing`` and can be submitted again.
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from vlmq import keys
from vlmq.jobs import JobStatus
from vlmq.settings import Settings
from vlmq.storage import Storage
from vlmq.workers.periodic import FleetPeriodic

log = logging.getLogger(__name__)
SCAN_COUNT = 1000  # records read per SCAN step
FINAL = {s.value for s in JobStatus if s.is_final}


def sweep_period(retention: int) -> float:
    """Seconds between sweeps: a tenth of the retention, from one minute to one hour."""
    return min(3600.0, max(60.0, retention / 10))


def live_inputs(redis: Any) -> set[str]:
    """Input keys named by jobs that have not ended (a record without a known final status counts as live)."""
    live = set()
    for names in _scan_batches(redis, keys.job_pattern()):
        pipe = redis.pipeline(transaction=False)
        for name in names:
            pipe.hmget(name, "status", "input_key", "input_keys")  # input_keys: every image of a messages job
        for status, input_key, input_keys in pipe.execute():
            if (status or b"").decode(errors="replace") not in FINAL:
                live.update(k.decode(errors="replace") for k in (input_key,) if k)
                live.update(_keys_of(input_keys))
    return live


def _keys_of(input_keys: bytes | None) -> list[str]:
    try:
        found = json.loads(input_keys or b"[]")
    except ValueError:  # a forged record protects nothing
        return []
    return [k for k in found if isinstance(k, str)] if isinstance(found, list) else []


def _scan_batches(redis: Any, pattern: str) -> Iterator[list[bytes]]:
    cursor = None
    while cursor != 0:
        cursor, names = redis.scan(cursor or 0, match=pattern, count=SCAN_COUNT)
        if names:
            yield names


class RetentionSweeper(FleetPeriodic):
    """Deletes input and result objects (every tenant's) older than ``retention`` seconds, once per period per fleet.

    Args:
        redis: a Redis client (the lock and the job records).
        storage: the pool's object store.
        retention: seconds objects are kept (must be positive).
        name: this worker, stored in the lock for operators.
        period: seconds between sweeps (default :func:`sweep_period`).
        clock: the time now, in seconds since the epoch (tests move it).
    """

    what = "retention sweep"

    def __init__(self, redis: Any, storage: Storage, retention: int, name: str = "", period: float | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        if retention <= 0:
            raise ValueError(f"retention must be positive, got {retention}")
        super().__init__(redis, keys.retention_lock(), period or sweep_period(retention), name, clock)
        self.storage, self.retention = storage, retention

    def sweep(self) -> int | None:
        """One sweep if no other worker swept this period; returns the objects deleted (None: not our turn)."""
        if not self.my_turn():
            return None
        cutoff = self.clock() - self.retention
        old = [key for prefix in keys.RETAINED_PREFIXES for key in self.storage.list_older(prefix, cutoff)]
        old_inputs = [key for key in old if keys.object_kind(key) == "input"]  # listed before the records are read
        deleted = self._delete(key for key in old if keys.object_kind(key) == "result")
        live = live_inputs(self.redis)
        deleted += self._delete(key for key in old_inputs if key not in live)
        log.info("retention sweep: deleted %d objects older than %d s; kept %d old inputs of live jobs",
                 deleted, self.retention, len(live.intersection(old_inputs)))
        return deleted

    def _delete(self, doomed: Iterable[str]) -> int:
        count = 0
        for key in doomed:
            self.storage.delete(key)
            count += 1
        return count


def start_sweeper(settings: Settings, redis: Any, storage: Storage, name: str) -> RetentionSweeper | None:
    """Start the sweeper thread when ``VLMQ_RETENTION`` is set (the default 0 keeps everything)."""
    if not settings.retention:
        return None
    sweeper = RetentionSweeper(redis, storage, settings.retention, name)
    sweeper.start()
    return sweeper
