"""The orphan sweep: the job record is the truth, the message a means.

A record left ``queued`` or ``started`` whose message is in no class queue, no worker queue and no unacked
entry will never run: a path that acked or dropped it (an outage mid-finish, a broker that lost its last
second of AOF, a failover to a lagging replica, a bug nobody foresaw). Every worker runs a sweeper thread; a
``SET NX EX`` lock (``keys.orphan_lock``) lets one worker sweep per period across the fleet, like the
retention sweep.

A sweep reads the active records older than that threshold (none: it stops there, so a healthy pool whose
jobs end within it never reads a message), then every message (queue lists, then kombu's unacked hash). Those reads
are not one atomic step, so a message moving between structures could look missing once; a job is re-sent
only when it was missing in sweeps at least ``visibility_timeout + orphan_grace`` seconds apart and is still
active. The re-send is one script: if the record is still active, its message (rebuilt from the record:
``vlmq.wire``) goes to the shared class queue at the job's priority, the record back to ``queued``, and the
record's ``resent`` and the fleet's counter (``keys.orphans_resent``) go up. The next delivery counts as an
attempt, so a job that keeps losing its message ends as ``poison``.
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from vlmq import keys
from vlmq.fleet import message_job_id
from vlmq.jobs import JobStatus
from vlmq.settings import Settings
from vlmq.wire import MessageWriter
from vlmq.workers.periodic import FleetPeriodic

log = logging.getLogger(__name__)
SCAN_COUNT = 1000
ACTIVE = (JobStatus.QUEUED.value, JobStatus.STARTED.value)
COUNTER_TTL = 30 * 24 * 3600  # the re-sent counter lives a month past its last increment
FIELDS = ("status", "model", "cost_class", "priority", "created_at")

# KEYS[1] the record, KEYS[2] the queue list, KEYS[3] the queue's wake list, KEYS[4] the fleet's counter;
# ARGV[1] the message, ARGV[2] the counter's TTL, ARGV[3] now, ARGV[4] the queue. Returns 1 if re-sent, 0 if the
# job ended meanwhile.
RESEND_SCRIPT = """
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'queued' and status ~= 'started' then return 0 end
redis.call('HSET', KEYS[1], 'status', 'queued', 'queued_again_at', ARGV[3], 'queue', ARGV[4])
redis.call('HINCRBY', KEYS[1], 'resent', 1)
redis.call('LPUSH', KEYS[2], ARGV[1])
redis.call('LPUSH', KEYS[3], '1')
redis.call('LTRIM', KEYS[3], 0, 0)
redis.call('EXPIRE', KEYS[3], 10)
redis.call('INCR', KEYS[4])
redis.call('EXPIRE', KEYS[4], ARGV[2])
return 1
"""


def sweep_period(visibility_timeout: int) -> float:
    """Seconds between sweeps: half the visibility timeout, from 1 s to one minute."""
    return min(60.0, max(1.0, visibility_timeout / 2))


def _scan(redis: Any, pattern: str) -> Iterator[list[bytes]]:
    cursor = None
    while cursor != 0:
        cursor, names = redis.scan(cursor or 0, match=pattern, count=SCAN_COUNT)
        if names:
            yield names


def active_jobs(redis: Any) -> dict[str, dict[str, str]]:
    """Job id -> status, model, class and priority of every record in ``queued`` or ``started``."""
    active = {}
    prefix = keys.job("")
    for names in _scan(redis, keys.job_pattern()):
        pipe = redis.pipeline(transaction=False)
        for name in names:
            pipe.hmget(name, *FIELDS)
        for name, values in zip(names, pipe.execute(), strict=True):
            record = {f: (v or b"").decode(errors="replace") for f, v in zip(FIELDS, values, strict=True)}
            if record["status"] in ACTIVE:
                active[name.decode(errors="replace")[len(prefix):]] = record
    return active


def message_ids(redis: Any) -> set[str]:
    """Job ids of every message in a queue list (class and worker queues, every priority) or unacked."""
    ids: set[str] = set()
    for names in _scan(redis, keys.queue_pattern()):
        lists = [n for n in names if keys.is_queue_list(n.decode(errors="replace"))]
        pipe = redis.pipeline(transaction=False)
        for name in lists:
            pipe.lrange(name, 0, -1)
        for messages in pipe.execute():
            ids.update(j for raw in messages if (j := message_job_id(raw)))
    for raw in redis.hvals(keys.UNACKED):
        try:
            message = json.loads(raw)[0]  # [message, exchange, routing_key]
        except (ValueError, TypeError, IndexError, KeyError):
            continue
        if job_id := message_job_id(message):
            ids.add(job_id)
    return ids


def _created(record: dict[str, str]) -> float:
    try:
        return float(record["created_at"])
    except ValueError:  # a record without a readable stamp is treated as old
        return 0.0


class OrphanSweeper(FleetPeriodic):
    """Re-sends the message of every active job whose message is nowhere, once per period per fleet.

    Args:
        redis: a Redis client.
        settings: ``visibility_timeout`` and ``orphan_grace`` set how long a message may be missing.
        name: this worker, stored in the lock for operators.
        clock: the time now, in seconds since the epoch (tests move it).
    """

    what = "orphan sweep"

    def __init__(self, redis: Any, settings: Settings, name: str = "",
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__(redis, keys.orphan_lock(), sweep_period(settings.visibility_timeout), name, clock)
        self.after = settings.visibility_timeout + settings.orphan_grace
        self.writer = MessageWriter()

    def sweep(self) -> int | None:
        """One sweep if no other worker swept this period; returns the jobs re-sent (None: not our turn)."""
        if not self.my_turn():
            return None
        now = self.clock()
        # a job younger than the threshold cannot be due; without old active jobs no message is read at all
        active = {job_id: r for job_id, r in active_jobs(self.redis).items() if now - _created(r) >= self.after}
        present = message_ids(self.redis) if active else set()
        seen = {k.decode(): float(v) for k, v in self.redis.hgetall(keys.orphans_seen()).items()}
        missing = {job_id: seen.get(job_id, now) for job_id in active if job_id not in present}
        due = [job_id for job_id, since in missing.items() if now - since >= self.after]
        resent = sum(self._resend(job_id, active[job_id]) for job_id in due)
        waiting = {job_id: since for job_id, since in missing.items() if job_id not in due}
        pipe = self.redis.pipeline()
        pipe.delete(keys.orphans_seen())
        if waiting:
            pipe.hset(keys.orphans_seen(), mapping=waiting)
            pipe.expire(keys.orphans_seen(), max(1, round(self.after + 2 * self.period)))
        pipe.execute()
        if missing:
            log.info("orphan sweep: %d active jobs have no message; re-sent %d", len(missing), resent)
        return resent

    def _resend(self, job_id: str, record: dict[str, str]) -> int:
        try:
            queue, priority = keys.queue(record["model"], record["cost_class"]), int(record["priority"] or 0)
            if priority not in keys.PRIORITY_STEPS or not record["model"] or not record["cost_class"]:
                raise ValueError(priority)
        except ValueError:
            log.warning("orphan sweep: job %s has a record it cannot re-send from: %s", job_id, record)
            return 0
        message = self.writer.message(job_id, queue, priority)
        done = self.redis.eval(RESEND_SCRIPT, 4, keys.job(job_id), keys.priority_list(queue, priority),
                               keys.wake(queue), keys.orphans_resent(), message, COUNTER_TTL, repr(self.clock()),
                               queue)
        if done:
            log.warning("job %s was %s with its message lost; re-sent it to %s", job_id, record["status"], queue)
        return int(done)


def start_orphan_sweeper(settings: Settings, redis: Any, name: str) -> OrphanSweeper:
    sweeper = OrphanSweeper(redis, settings, name)
    sweeper.start()
    return sweeper
