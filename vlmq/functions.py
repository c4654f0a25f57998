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

# KEYS[1]=job hash, KEYS[2]=done list, KEYS[3] (optional)=flag key set to "1" when the job exists;
# ARGV[1]=allowed current statuses (comma separated), ARGV[2]=new status, ARGV[3]=ttl seconds (0 = keep the
# record's TTL), ARGV[4]=1 if the new status is final, ARGV[5]=done-list TTL, ARGV[6]=batch key prefix,
# ARGV[7]=the batch id prefix of the job's tenant, ARGV[8..]=field, value pairs.
# A final transition of a batch's job (a record with ``batch_id``) also counts it in its batch hash
# (``n_<status>``), so each request is counted exactly once, by whoever ended it; only a batch of the job's own
# tenant is counted, whatever a forged record names (that key is derived from the record: a single-node Redis or
# Valkey, not Redis Cluster).
# Returns the previous status, false if the job is missing, or "!<status>" if the transition was refused.
# Run as the function ``transition`` of the library in ``vlmq.functions`` (FCALL; tenants hold no EVAL).
TRANSITION = """
local cur = redis.call('HGET', KEYS[1], 'status')
if not cur then return false end
local ttl = tonumber(ARGV[3])
if KEYS[3] then redis.call('SET', KEYS[3], '1', 'EX', math.max(ttl, 1)) end
local allowed = false
for s in string.gmatch(ARGV[1], '[^,]+') do if s == cur then allowed = true end end
if not allowed then return '!' .. cur end
redis.call('HSET', KEYS[1], 'status', ARGV[2])
for i = 8, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
if ttl > 0 then redis.call('EXPIRE', KEYS[1], ttl) end
if ARGV[4] == '1' then
  redis.call('RPUSH', KEYS[2], ARGV[2])
  redis.call('EXPIRE', KEYS[2], ARGV[5])
  local batch = redis.call('HGET', KEYS[1], 'batch_id')
  if batch and string.sub(batch, 1, #ARGV[7]) == ARGV[7] and redis.call('EXISTS', ARGV[6] .. batch) == 1 then
    redis.call('HINCRBY', ARGV[6] .. batch, 'n_' .. ARGV[2], 1)
  end
end
return cur
"""


# KEYS[1] the job record, KEYS[2] the shared queue's list for the job's priority, KEYS[3] the shared queue's wake
# list, KEYS[4] the input's hot key, KEYS[5] (optional) the job's idempotency key. ARGV[1] the record's TTL,
# ARGV[2] the wake token's, ARGV[3] the message (routed to the shared queue), ARGV[4] the shared queue, ARGV[5] the
# cost class, ARGV[6] the bound (0: routing off), ARGV[7] the worker queues' name prefix, ARGV[8] the list-name
# suffix of each priority step, '|'-joined, ARGV[9] this job's suffix, ARGV[10] the wake lists' prefix, ARGV[11]
# the idempotency key's pending value ('~<job id> <fingerprint>', vlmq.client), ARGV[12..] the record's field/value
# pairs. Routes, writes the record before the message and pushes a wake token, all in one atomic step (a batch's
# later jobs see its earlier ones in the worker queue's depth); then publishes the job id under its idempotency key
# (the pending value without its '~', with the record's TTL) if the key is still this call's or has lapsed, so a
# key names a job only once the job's record exists. Returns the queue. Run as the function ``enqueue`` of the
# library in ``vlmq.functions`` (FCALL; tenants hold no EVAL).
ENQUEUE = """
local queue, list, wake, message = ARGV[4], KEYS[2], KEYS[3], ARGV[3]
local route = tonumber(ARGV[6]) > 0 and redis.call('GET', KEYS[4])
if route then
  local worker, classes = string.match(route, '^([%w_%-]+) ([%w_%-,]*)$')
  if worker and #worker <= 64 and string.find(',' .. classes .. ',', ',' .. ARGV[5] .. ',', 1, true) then
    local own = ARGV[7] .. worker
    local depth = 0
    for suffix in string.gmatch('|' .. ARGV[8], '|([^|]*)') do depth = depth + redis.call('LLEN', own .. suffix) end
    if depth < tonumber(ARGV[6]) then
      local s, e = string.find(message, '"routing_key": ' .. cjson.encode(queue), 1, true)
      message = string.sub(message, 1, s - 1) .. '"routing_key": ' .. cjson.encode(own) .. string.sub(message, e + 1)
      queue, list, wake = own, own .. ARGV[9], ARGV[10] .. own
    end
  end
end
redis.call('HSET', KEYS[1], unpack(ARGV, 12))
redis.call('HSET', KEYS[1], 'queue', queue)
redis.call('EXPIRE', KEYS[1], ARGV[1])
redis.call('LPUSH', list, message)
redis.call('LPUSH', wake, '1')
redis.call('LTRIM', wake, 0, 0)
redis.call('EXPIRE', wake, ARGV[2])
if KEYS[5] then
  local bound = redis.call('GET', KEYS[5])
  if not bound or bound == ARGV[11] then redis.call('SET', KEYS[5], string.sub(ARGV[11], 2), 'EX', ARGV[1]) end
end
return queue
"""


# KEYS[1] an idempotency key; ARGV[1] the value this caller bound it to. Deletes the key only while it holds that
# value, so a caller never releases a binding that is no longer its own (vlmq.client). Returns 1 if deleted.
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


@functools.cache
def library() -> tuple[str, str]:
    """``(name, source)`` of the library: every producer script, each as ``<name>_<function>``."""
    bodies = {"transition": TRANSITION, "enqueue": ENQUEUE, "release": RELEASE}
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
