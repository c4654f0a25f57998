"""Cache-affinity routing: a job whose image a live worker holds hot goes to that worker's own queue.

Workers publish what they hold (``vlmq.keys.hot_input``: input object -> ``<worker> <classes>``, expiring
unless the worker renews it, deleted when it evicts the image). The producer reads the route of each job's
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

from vlmq import keys

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


def choose_queue(model: str, cost_class: str, route: Route | None, depth: int, bound: int) -> str:
    """The queue for one job: the hot worker's own queue if it takes the class and has room, else the shared one.

    Args:
        model, cost_class: the job's model and cost class.
        route: the route of the job's input (None: not hot anywhere, or routing is off).
        depth: jobs already in (or routed in this batch to) that worker's queue for this class.
        bound: most jobs a worker queue may hold (``VLMQ_AFFINITY_QUEUE_BOUND``).
    """
    if route is None or cost_class not in route.classes or depth >= bound:
        return keys.queue(model, cost_class)
    return keys.worker_queue(model, cost_class, route.worker)


def route_jobs(redis: Any, jobs: Sequence[tuple[str, str, str]], bound: int) -> list[str]:
    """The queue of each ``(input_key, model, cost_class)``: two pipelined round trips for the whole batch."""
    if not jobs:
        return []
    pipe = redis.pipeline(transaction=False)
    for input_key, model, _ in jobs:
        pipe.get(keys.hot_input(input_key, model))
    routes = [Route.decode(v) for v in pipe.execute()]
    owned = [keys.worker_queue(m, c, r.worker) if r else "" for (_, m, c), r in zip(jobs, routes, strict=True)]
    targets = sorted(set(owned) - {""})
    depth = dict(zip(targets, queue_depths(redis, targets), strict=True))
    queues = []
    for (_, model, cost_class), route, own in zip(jobs, routes, owned, strict=True):
        queue = choose_queue(model, cost_class, route, depth.get(own, 0), bound)
        if queue == own:
            depth[own] += 1  # the next job of this batch sees the queue one longer
        queues.append(queue)
    return queues


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
