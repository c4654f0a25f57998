"""Queue figures read from Redis (what /metrics and `vlmq top` show) and the `vlmq top` screen."""
from __future__ import annotations

import io
import json
import time

import pytest
from PIL import Image

from vlmq import keys
from vlmq.cli import main
from vlmq.client import Client
from vlmq.fleet import QueueStats, queue_stats, render_top, worker_statuses
from vlmq.settings import Settings


def png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 30, 30)).save(buf, "PNG")
    return buf.getvalue()


def worker(model: str = "tiny-shapes", finished: int = 3, generated: int = 100, at: float = 1000.0) -> dict:
    return {"model": model, "device": "cpu", "queues": "vlmq.tiny-shapes.xs", "held": "1", "held_cost": "2304",
            "budget": "32768", "finished": str(finished), "failed": "0", "prompt_tokens": str(10 * generated),
            "generated_tokens": str(generated), "started_at": "900", "updated_at": str(at)}


def test_the_top_screen_shows_queues_workers_and_rates_between_refreshes() -> None:
    queues = [QueueStats("tiny-shapes", "xs", 5, 2, 12.34), QueueStats("tiny-shapes", "s", 0, 0, 0.0)]
    first = render_top(queues, {"host:1": worker()})
    lines = first.splitlines()
    assert lines[1].split() == ["tiny-shapes", "xs", "5", "2", "12.3"]
    assert lines[2].split() == ["tiny-shapes", "s", "0", "0", "0.0"]
    assert "1 worker(s)" in lines
    assert lines[-1].split() == ["host:1", "tiny-shapes", "cpu", "1", "2304/32768", "3", "0", "-", "-"]
    assert "lost messages re-sent from job records: 0" in lines
    assert "lost messages re-sent from job records: 3" in render_top(queues, {}, resent=3).splitlines()
    later = render_top(queues, {"host:1": worker(finished=5, generated=300, at=1004.0)}, {"host:1": worker()})
    assert later.splitlines()[-1].split()[-2:] == ["500.0", "50.0"]  # tokens/s in and out over the 4 s


def test_queue_stats_count_waiting_and_unacked_jobs_and_the_oldest_age(redis_url, redis_client, tmp_path) -> None:
    settings = Settings(broker_url=redis_url, storage_url=f"file://{tmp_path}")
    with Client(settings=settings) as client:
        jobs = [client.submit(png(), "Describe the image.", priority=p) for p in (5, 0, 9)]
    cost_class = jobs[0].info()["cost_class"]
    queue = keys.queue("tiny-shapes", cost_class)
    # one message is delivered to a worker: kombu's unacked entry is [message, exchange, routing key]
    message = redis_client.rpop(keys.priority_list(queue, 0)).decode()
    redis_client.hset(keys.UNACKED, "tag-1", f'[{message},"",{json.dumps(queue)}]')
    oldest = min(float(j.info()["queued_at"]) for j in jobs)
    [stats] = queue_stats(redis_client, [("tiny-shapes", cost_class)], now=oldest + 60)
    assert (stats.waiting, stats.held) == (2, 1)
    assert stats.oldest_age_s == pytest.approx(60, abs=0.01)
    [empty] = queue_stats(redis_client, [("tiny-shapes", "xl")])
    assert (empty.waiting, empty.held, empty.oldest_age_s) == (0, 0, 0.0)
    # a job routed to a worker's own queue (cache affinity) is held in its class too
    message = next(m for lst in keys.queue_lists(queue) if (m := redis_client.rpop(lst))).decode()
    own = keys.worker_queue("tiny-shapes", cost_class, "w1")
    redis_client.hset(keys.UNACKED, "tag-2", f'[{message},"",{json.dumps(own)}]')
    [stats] = queue_stats(redis_client, [("tiny-shapes", cost_class)], now=oldest + 60)
    assert (stats.waiting, stats.held) == (1, 2)
    redis_client.delete(keys.UNACKED)


def test_vlmq_top_once_prints_live_workers(redis_url, redis_client, monkeypatch, capsys) -> None:
    redis_client.hset(keys.worker_status("host:7"), mapping=worker(at=time.time()))
    redis_client.expire(keys.worker_status("host:7"), 60)  # as workers write it
    assert set(worker_statuses(redis_client)) == {"host:7"}
    monkeypatch.setenv("VLMQ_BROKER_URL", redis_url)
    assert main(["top", "--once"]) == 0
    out = capsys.readouterr().out
    assert "1 worker(s)" in out and "host:7" in out
    assert [line.split()[:3] for line in out.splitlines()[1:6]] == [["tiny-shapes", c, "0"]
                                                                     for c in ("xs", "s", "m", "l", "xl")]
