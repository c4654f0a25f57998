"""What the pool is doing, read from Redis: queue depths and ages, live workers; ``vlmq top`` renders it.

Workers export the same queue figures on ``/metrics`` (``vlmq.workers.metrics``); both read them here.
"""
from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vlmq import keys
from vlmq.store import decode_record


@dataclass(slots=True)
class QueueStats:
    model: str
    cost_class: str
    waiting: int  # messages in the queue's lists (every priority step)
    held: int  # delivered to a worker and not acked yet (kombu's unacked hash)
    oldest_age_s: float  # seconds since the oldest waiting or held job was queued (0 when none)


def message_job_id(raw: bytes | str | dict[str, Any]) -> str | None:
    """The job id in a vlmq task message (kombu's JSON envelope, base64 JSON body ``[[job_id], {}, {}]``)."""
    try:
        envelope = raw if isinstance(raw, dict) else json.loads(raw)
        args = json.loads(base64.b64decode(envelope["body"]))[0]
        return args[0] if isinstance(args[0], str) else None
    except (ValueError, KeyError, IndexError, TypeError):
        return None


def _held_by_queue(redis: Any, queues: set[str]) -> dict[str, list[str]]:
    """Job ids of every unacked message of ``queues`` (an unacked entry is ``[message, exchange, routing_key]``)."""
    held: dict[str, list[str]] = {q: [] for q in queues}
    for raw in redis.hvals(keys.UNACKED):
        try:
            message, _, routing_key = json.loads(raw)
        except (ValueError, TypeError):
            continue
        if not isinstance(routing_key, str):
            continue
        routing_key = keys.shared_queue(routing_key)  # a worker's own queue counts in its class
        if routing_key in held:
            held[routing_key].append(message_job_id(message) or "")
    return held


def queue_stats(redis: Any, model_classes: Iterable[tuple[str, str]], now: float | None = None) -> list[QueueStats]:
    """Depth, unacked count and oldest age of each (model, cost class) queue."""
    pairs = list(model_classes)
    names = {keys.queue(m, c): (m, c) for m, c in pairs}
    pipe = redis.pipeline(transaction=False)
    for name in names:
        for lst in keys.queue_lists(name):
            pipe.llen(lst)
            pipe.lindex(lst, -1)  # the next message popped from this list: its oldest
    replies = pipe.execute()
    held = _held_by_queue(redis, set(names))
    per_list = 2 * len(keys.PRIORITY_STEPS)
    out = []
    for i, (name, (model, cost_class)) in enumerate(names.items()):
        chunk = replies[i * per_list:(i + 1) * per_list]
        tails = [message_job_id(raw) for raw in chunk[1::2] if raw]
        ages = _ages(redis, [j for j in tails + held[name] if j], time.time() if now is None else now)
        out.append(QueueStats(model, cost_class, sum(chunk[0::2]), len(held[name]), max(ages, default=0.0)))
    return out


def _ages(redis: Any, job_ids: Sequence[str], now: float) -> list[float]:
    pipe = redis.pipeline(transaction=False)
    for job_id in job_ids:
        pipe.hget(keys.job(job_id), "queued_at")
    return [max(0.0, now - float(at)) for at in pipe.execute() if at]


def orphans_resent(redis: Any) -> int:
    """Messages the orphan sweep re-sent from job records across the fleet (``vlmq.workers.orphans``)."""
    return int(redis.get(keys.orphans_resent()) or 0)


def read_hashes(redis: Any, prefix: str) -> dict[str, dict[str, str]]:
    """Every hash whose key starts with ``prefix``, by the rest of its key (as text), in key order."""
    names = sorted(k.decode() if isinstance(k, bytes) else k for k in redis.scan_iter(match=f"{prefix}*", count=500))
    pipe = redis.pipeline(transaction=False)
    for name in names:
        pipe.hgetall(name)
    return {name[len(prefix):]: decode_record(raw) for name, raw in zip(names, pipe.execute(), strict=True) if raw}


def worker_statuses(redis: Any) -> dict[str, dict[str, str]]:
    """Every live worker's status hash (``keys.worker_status``), by worker name."""
    return read_hashes(redis, keys.worker_status(""))


def _rate(now: Mapping[str, str], before: Mapping[str, str] | None, name: str) -> str:
    if before is None:
        return "-"
    dt = float(now["updated_at"]) - float(before["updated_at"])
    if dt <= 0:
        return "-"
    return f"{(float(now[name]) - float(before[name])) / dt:.1f}"


def render_top(queues: Sequence[QueueStats], workers: Mapping[str, Mapping[str, str]],
               previous: Mapping[str, Mapping[str, str]] | None = None, resent: int = 0) -> str:
    """The ``vlmq top`` screen: one row per queue, one per worker (token rates against ``previous``), and how many
    lost messages the orphan sweep re-sent (``resent``)."""
    lines = [f"{'model':<20} {'class':<6} {'waiting':>8} {'held':>6} {'oldest s':>9}"]
    lines += [f"{q.model:<20} {q.cost_class:<6} {q.waiting:>8} {q.held:>6} {q.oldest_age_s:>9.1f}" for q in queues]
    lines += ["", f"lost messages re-sent from job records: {resent}"]
    lines += ["", f"{len(workers)} worker(s)",
              f"{'worker':<28} {'model':<14} {'device':<8} {'held':>4} {'cost/budget':>13} {'done':>6} "
              f"{'failed':>6} {'tok/s in':>9} {'tok/s out':>9}"]
    for name, w in sorted(workers.items()):
        before = (previous or {}).get(name)
        lines.append(f"{name:<28} {w['model']:<14} {w['device']:<8} {w['held']:>4} "
                     f"{w['held_cost'] + '/' + w['budget']:>13} {w['finished']:>6} {w['failed']:>6} "
                     f"{_rate(w, before, 'prompt_tokens'):>9} {_rate(w, before, 'generated_tokens'):>9}")
    return "\n".join(lines) + "\n"


def watched_queues(settings: Any, workers: Mapping[str, Mapping[str, str]]) -> list[tuple[str, str]]:
    """(model, cost class) of every configured or served model, for every configured class."""
    from vlmq.models import BUNDLED_MODEL, cost_classes

    models = dict.fromkeys([BUNDLED_MODEL, *settings.models, *(w["model"] for w in workers.values())])
    return [(m, c) for m in models for c in cost_classes(settings).names]


def run_top(settings: Any, interval: float = 2.0, once: bool = False) -> int:
    """``vlmq top``: redraw the screen every ``interval`` s until Ctrl-C (``once``: print one screen)."""
    import redis as redis_lib

    client = redis_lib.Redis.from_url(settings.broker_url, socket_connect_timeout=3)
    previous: dict[str, dict[str, str]] | None = None
    while True:
        workers = worker_statuses(client)
        screen = render_top(queue_stats(client, watched_queues(settings, workers)), workers, previous,
                            orphans_resent(client))
        if once:
            print(screen, end="")
            return 0
        print(f"\x1b[H\x1b[2Jvlmq top  {settings.broker_url}  {time.strftime('%H:%M:%S')}\n\n{screen}", end="",
              flush=True)
        previous = {name: dict(w) for name, w in workers.items()}
        time.sleep(interval)
