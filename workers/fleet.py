"""What a worker tells the fleet, and the fleet chores every live worker shares.

- Hot routes (``vlmq.keys.hot_input``): an input this worker started or served routes its next jobs here
  (``vlmq.affinity``). A route is claimed only where none is (the first server keeps it while it renews),
  renewed every ``VLMQ_AFFINITY_TTL / 3`` s while the image is in the worker's hot set, deleted when the hot
  set evicts it, and expires by itself when the worker dies. The hot set mirrors the encoder cache: least
  recently served first, bounded by the cache's bytes, each image counted at its encoder output's size.
- Heartbeat (``vlmq.keys.worker_stats``): model, classes and the backend's cache counters, with the same TTL.
- Drain: once per beat period, by whichever live worker takes the sweep lock (``vlmq.keys.affinity_sweep``)
  first, each registered worker queue (``vlmq.keys.affinity_workers``) is drained by ``vlmq.affinity.drain``:
  a dead worker's whole queue, a live one's excess over the bound. A worker is forgotten once it has been
  dead for twice the visibility timeout (its unacked messages are back in its queue by then) and its queues
  are empty.

Everything here is best effort: a Redis error is logged and the next beat tries again; jobs never wait on it.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

from vlmq import affinity, keys
from vlmq.models import cost_classes
from vlmq.settings import Settings
from vlmq.workers.native import worker_thread

log = logging.getLogger(__name__)

# KEYS: hot routes; ARGV[1] this worker's route, ARGV[2] TTL. Claim a free route, renew one already ours.
CLAIM_SCRIPT = """
for i = 1, #KEYS do
  local owner = redis.call('GET', KEYS[i])
  if not owner then redis.call('SET', KEYS[i], ARGV[1], 'EX', ARGV[2])
  elseif owner == ARGV[1] then redis.call('EXPIRE', KEYS[i], ARGV[2]) end
end
return 0
"""
# KEYS: hot routes; ARGV[1] this worker's route. Delete the routes that are still ours.
FORGET_SCRIPT = """
for i = 1, #KEYS do
  if redis.call('GET', KEYS[i]) == ARGV[1] then redis.call('DEL', KEYS[i]) end
end
return 0
"""


class HotSet:
    """Inputs held hot, least recently served first, bounded in bytes (a model of the encoder cache's LRU)."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.num_used_bytes = 0
        self.entries: OrderedDict[str, int] = OrderedDict()  # input key -> bytes

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, key: str, num_bytes: int) -> list[str]:
        """Mark ``key`` most recently served; returns the keys evicted to stay within the bytes (maybe ``key``)."""
        self.num_used_bytes += num_bytes - self.entries.pop(key, 0)
        self.entries[key] = num_bytes
        evicted = []
        while self.num_used_bytes > self.capacity_bytes and self.entries:
            old, size = self.entries.popitem(last=False)
            self.num_used_bytes -= size
            evicted.append(old)
        return evicted


class FleetReporter:
    """One worker's hot routes, heartbeat and counters, and its share of the drain (see the module docstring)."""

    def __init__(self, redis: Any, settings: Settings, model: str, name: str, classes: Iterable[str],
                 cache_stats: Callable[[], dict[str, int]]) -> None:
        self.redis = redis
        self.settings = settings
        self.model = model
        self.worker = keys.worker_slug(name)
        self.classes = sorted(classes)
        self.all_classes = list(cost_classes(settings).names)  # every class's worker queue may hold jobs to drain
        self.route = affinity.Route(self.worker, frozenset(self.classes)).encode()
        self.cache_stats = cache_stats
        stats = cache_stats()
        self.bytes_per_token = int(stats.get("encoder_bytes_per_token", 0))
        self.hot = HotSet(int(stats.get("encoder_cache_bytes", 0)))
        self.jobs_served = 0
        self.period = max(0.5, settings.affinity_ttl / 3)
        self.forget_after = 2 * settings.visibility_timeout + settings.affinity_ttl
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = worker_thread(self._run, "vlmq-fleet")
        self.archive_model_hash: str | None = None  # set by start() when the backend archives KV

    def start(self, archive_model_hash: str | None = None) -> None:
        """First beat and the beat thread; names the backend's archive (``kv/<hash>/``) for ``vlmq cache``."""
        self.archive_model_hash = archive_model_hash
        self.beat()
        self._thread.start()

    def stop(self) -> None:
        """Stop beating and drop the heartbeat now, so live workers drain this worker's queues at once."""
        self._stopped.set()
        self._safely(lambda: self.redis.delete(keys.worker_stats(self.worker)))

    def claim(self, input_key: str) -> None:
        """A job on ``input_key`` started here: route its next jobs here unless another worker holds it."""
        if self.settings.affinity:
            self._safely(lambda: self._claim([keys.hot_input(input_key, self.model)]))

    def served(self, input_key: str, image_tokens: int) -> None:
        """A job on ``input_key`` finished here: keep it hot (evicting the least recent), publish the counters."""
        with self._lock:
            self.jobs_served += 1
            evicted = self.hot.add(input_key, image_tokens * self.bytes_per_token)
            held = input_key in self.hot
        if self.settings.affinity:
            self._safely(lambda: self._update_routes(input_key if held else None, evicted))
        self._safely(self._publish_stats)

    def beat(self) -> None:
        """Renew the heartbeat, counters and hot routes; drain the worker queues if no other worker does now."""
        self._safely(self._publish_stats)
        if self.settings.affinity:
            with self._lock:
                held = [keys.hot_input(k, self.model) for k in self.hot.entries]
            self._safely(lambda: self._claim(held))
        self._safely(lambda: self._take_sweep() and self.sweep())

    def _take_sweep(self) -> bool:
        # one sweep per period across the fleet: the drain checks every worker queue, so n workers sweeping
        # each period would cost n times the Redis calls for the same moves
        lock = keys.affinity_sweep(self.model)
        return bool(self.redis.set(lock, self.worker, nx=True, px=int(self.period * 1000)))

    def sweep(self) -> int:
        """Drain every registered worker queue (dead: all of it; live: past the bound); returns jobs moved."""
        moved = 0
        now = time.time()
        for member, last_seen in self.redis.zrange(keys.affinity_workers(self.model), 0, -1, withscores=True):
            worker = member.decode()
            moved += sum(affinity.drain(self.redis, self.model, c, worker, self.settings.affinity_queue_bound)
                         for c in self.all_classes)
            if now - last_seen > self.forget_after and not self._has_jobs(worker):
                self.redis.zrem(keys.affinity_workers(self.model), worker)
        if moved:
            log.info("moved %d jobs from worker queues back to the shared queues", moved)
        return moved

    def _has_jobs(self, worker: str) -> bool:
        queues = [keys.worker_queue(self.model, c, worker) for c in self.all_classes]
        return self.redis.exists(keys.worker_stats(worker)) > 0 or sum(affinity.queue_depths(self.redis, queues)) > 0

    def _claim(self, hot_keys: list[str]) -> None:
        if hot_keys:
            self.redis.eval(CLAIM_SCRIPT, len(hot_keys), *hot_keys, self.route, self.settings.affinity_ttl)

    def _update_routes(self, held: str | None, evicted: list[str]) -> None:
        if held is not None:
            self._claim([keys.hot_input(held, self.model)])
        gone = [keys.hot_input(k, self.model) for k in evicted]
        if gone:
            self.redis.eval(FORGET_SCRIPT, len(gone), *gone, self.route)

    def _publish_stats(self) -> None:
        if self._stopped.is_set():
            return
        own = ",".join(self.classes) if self.settings.affinity else ""  # the drain spares only queues consumed
        fields = {"model": self.model, "classes": ",".join(self.classes), "own_queue_classes": own,
                  "at": repr(time.time()),
                  "jobs_served": self.jobs_served, "hot_inputs": len(self.hot), **self.cache_stats()}
        key = keys.worker_stats(self.worker)
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(key, mapping=fields).expire(key, self.settings.affinity_ttl)
        if self.archive_model_hash:  # names the archive while a worker serves it, and a job TTL after
            pipe.hset(keys.kv_models(), self.archive_model_hash, self.model).expire(keys.kv_models(),
                                                                                  self.settings.job_ttl)
        if self.settings.affinity:
            # the registry the drain walks; it outlives a dead fleet by a job TTL (its jobs' records expire then)
            pipe.zadd(keys.affinity_workers(self.model), {self.worker: time.time()})
            pipe.expire(keys.affinity_workers(self.model), self.settings.job_ttl)
        pipe.execute()

    def _safely(self, call: Callable[[], object]) -> None:
        try:
            call()
        except Exception as e:  # Redis down or restarting: routing and stats are best effort
            log.warning("fleet update failed: %s: %s", type(e).__name__, e)

    def _run(self) -> None:
        while not self._stopped.wait(self.period):
            self.beat()
