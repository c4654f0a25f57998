"""Cache-affinity routing: a job whose image a live worker holds hot goes to that worker's own queue.

Workers publish what they hold (``vlmq.keys.hot_input``: input object -> ``<worker> <classes>``, expiring
unless the worker renews it, deleted when it evicts the image). The producer's enqueue script
(``ENQUEUE_SCRIPT``, the same atomic step that writes the job's record and message) reads the route of the job's
input and sends the job to ``vlmq.<model>.<class>.w.<worker>`` (``vlmq.keys.worker_queue``) when that worker
consumes the job's class and its queue is under ``VLMQ_AFFINITY_QUEUE_BOUND``; otherwise, and always with
``VLMQ_AFFINITY=0``, to the shared class queue. A worker pops its own queue before the shared one, under the
same cost gate.

Nothing is ever stranded: live workers run ``DRAIN_SCRIPT`` over every registered worker queue
(``vlmq.keys.affinity_workers``); a dead worker's queue (no heartbeat, ``vlmq.keys.worker_stats``) moves back
to the shared queue whole, a live worker's keeps ``bound`` jobs. The move is one Lua step per queue, priority
lists included, and rewrites each message's routing key to the shared queue (the message gate checks that a
message names the queue it was popped from). Moved jobs go to the head of the shared queue, oldest first, as
kombu's own restore does.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from vlmq import functions, keys

DRAIN_BATCH = 1000  # messages moved per script call; callers loop while a call moves this many

# KEYS[1] the owner's heartbeat (worker_stats), KEYS[2..1+n] its queue's priority lists (priority order),
# KEYS[2+n..1+2n] the shared queue's, same order. ARGV[1] jobs a live owner keeps, ARGV[2] the worker queue's
# name, ARGV[3] the shared queue's, ARGV[4] most messages moved, ARGV[5] the cost class. Moves the excess
# (everything unless the owner is alive and consumes this queue: its heartbeat's own_queue_classes names the
# class), lowest priority list first, oldest first, to the head of the shared lists in their original order.
# Returns the number moved.
DRAIN_SCRIPT = """
local n = (#KEYS - 1) / 2
local keep = 0
local own = redis.call('HGET', KEYS[1], 'own_queue_classes')
if own and string.find(',' .. own .. ',', ',' .. ARGV[5] .. ',', 1, true) then keep = tonumber(ARGV[1]) end
local total = 0
for i = 2, n + 1 do total = total + redis.call('LLEN', KEYS[i]) end
local excess = math.min(total - keep, tonumber(ARGV[4]))
local old = '"routing_key": ' .. cjson.encode(ARGV[2])
local new = '"routing_key": ' .. cjson.encode(ARGV[3])
local moved = 0
for i = n + 1, 2, -1 do
  local items = {}
  while moved < excess do
    local item = redis.call('RPOP', KEYS[i])
    if not item then break end
    local s, e = string.find(item, old, 1, true)
    if s then item = string.sub(item, 1, s - 1) .. new .. string.sub(item, e + 1) end
    items[#items + 1] = item
    moved = moved + 1
  end
  for j = #items, 1, -1 do redis.call('RPUSH', KEYS[i + n], items[j]) end
end
return moved
"""


@dataclass(frozen=True, slots=True)
class Route:
    """Where a hot input lives: the worker (its slug) and the cost classes it consumes."""

    worker: str
    classes: frozenset[str]

    def encode(self) -> str:
        return f"{self.worker} {','.join(sorted(self.classes))}"

    @classmethod
    def decode(cls, value: bytes | str | None) -> Route | None:
        """The route stored under a hot key, or None for a missing or malformed one (then: the shared queue)."""
        if value is None:
            return None
        text = value.decode(errors="replace") if isinstance(value, bytes) else value
        worker, _, classes = text.partition(" ")
        if not worker or worker != keys.worker_slug(worker):
            return None
        return cls(worker, frozenset(c for c in classes.split(",") if c))


ENQUEUE_SCRIPT = functions.ENQUEUE  # the script (vlmq.functions holds the library's sources)
_SUFFIXES = "|".join(keys.priority_list("", p) for p in keys.PRIORITY_STEPS)


def enqueue_call(job_key: str, input_key: str, model: str, cost_class: str, priority: int, *,
                 bound: int, record_ttl: int, wake_ttl: int, message: bytes,
                 record: Sequence[Any], idempotency: tuple[str, str] | None = None) -> tuple[list[str], list[Any]]:
    """``(keys, args)`` of one ``ENQUEUE_SCRIPT`` call.

    The job goes to its input's hot worker's own queue when the input's route (``Route``, under
    ``keys.hot_input``) names a worker that takes this cost class and that queue holds fewer than ``bound``
    messages; otherwise, and always with ``bound`` 0 (routing off), to the shared class queue.

    Args:
        message: the job's message, routed to the shared queue (``vlmq.wire``); the script rewrites its
            routing key when it routes the job to a worker queue.
        record: the record's field/value pairs; the script adds the ``queue`` it chose.
        idempotency: the job's idempotency key and the pending value this call bound it to: the script publishes
            the job id under the key once the record is written.
    """
    shared = keys.queue(model, cost_class)
    script_keys = [job_key, keys.priority_list(shared, priority), keys.wake(shared), keys.hot_input(input_key, model)]
    script_keys += [idempotency[0]] if idempotency else []
    args = [record_ttl, wake_ttl, message, shared, cost_class, bound, keys.worker_queue_prefix(model, cost_class),
            _SUFFIXES, keys.priority_list("", priority), keys.wake(""), idempotency[1] if idempotency else "", *record]
    return script_keys, args


def queue_depths(redis: Any, queues: Iterable[str]) -> list[int]:
    """Messages waiting in each queue (all its priority lists), in one pipelined round trip."""
    names = list(queues)
    pipe = redis.pipeline(transaction=False)
    for name in names:
        for lst in keys.queue_lists(name):
            pipe.llen(lst)
    counts = pipe.execute()
    steps = len(keys.PRIORITY_STEPS)
    return [sum(counts[i * steps:(i + 1) * steps]) for i in range(len(names))]


def drain(redis: Any, model: str, cost_class: str, worker: str, bound: int) -> int:
    """Move a worker queue's excess (all of it if the worker is dead) back to the shared queue; returns how many."""
    source, shared = keys.worker_queue(model, cost_class, worker), keys.queue(model, cost_class)
    script_keys = [keys.worker_stats(worker), *keys.queue_lists(source), *keys.queue_lists(shared)]
    moved = 0
    while True:
        n = int(redis.eval(DRAIN_SCRIPT, len(script_keys), *script_keys, bound, source, shared, DRAIN_BATCH,
                           cost_class))
        moved += n
        if n < DRAIN_BATCH:
            return moved
