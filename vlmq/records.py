"""Job records in Redis and their atomic status transitions (shared by SDK and workers)."""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from vlmq import keys
from vlmq.jobs import JobStatus, decode_record, now

# KEYS[1]=job hash, KEYS[2]=done list; ARGV[1]=allowed current statuses (comma separated), ARGV[2]=new status,
# ARGV[3]=ttl seconds (0 = keep), ARGV[4..]=field, value pairs. Returns the previous status,
# or false if the job is missing, or "!<status>" if the transition was refused.
_TRANSITION = """
local cur = redis.call('HGET', KEYS[1], 'status')
if not cur then return false end
local allowed = false
for s in string.gmatch(ARGV[1], '[^,]+') do if s == cur then allowed = true end end
if not allowed then return '!' .. cur end
redis.call('HSET', KEYS[1], 'status', ARGV[2])
for i = 4, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
if tonumber(ARGV[3]) > 0 then
  redis.call('EXPIRE', KEYS[1], ARGV[3])
  redis.call('RPUSH', KEYS[2], ARGV[2])
  redis.call('EXPIRE', KEYS[2], 600)
end
return cur
"""


def transition(redis: Any, job_id: str, allowed: Iterable[JobStatus], new: JobStatus,
               fields: Mapping[str, object] | None = None, ttl: int = 0) -> tuple[bool, str | None]:
    """Move a job to ``new`` if its status is one of ``allowed``; stamp ``<new>_at``.

    A final status also wakes waiters blocked on the job's done list.

    Returns:
        (changed, previous status or None if the job does not exist).
    """
    pairs: list[object] = [f"{new.value}_at", repr(now())]
    for k, v in (fields or {}).items():
        pairs += [k, v]
    allowed_csv = ",".join(s.value for s in allowed)
    reply = redis.eval(_TRANSITION, 2, keys.job(job_id), keys.done(job_id), allowed_csv, new.value,
                       ttl if new.is_final else 0, *pairs)
    if reply is None:
        return False, None
    text = reply.decode() if isinstance(reply, bytes) else str(reply)
    if text.startswith("!"):
        return False, text[1:]
    return True, text


def read(redis: Any, job_id: str) -> dict[str, str]:
    """The job record as a str dict (empty if missing)."""
    return decode_record(redis.hgetall(keys.job(job_id)))
