"""The orphan sweep: an active job whose message is nowhere is re-sent from its record, once, and finishes once."""
from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from test_pool import png
from test_reliability import SLOW_WORKER, wait_status
from workerproc import WorkerProcess

from vlmq import keys
from vlmq.client import Client
from vlmq.fleet import message_job_id, orphans_resent
from vlmq.jobs import JobStatus
from vlmq.settings import Settings
from vlmq.workers.orphans import OrphanSweeper, message_ids

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
PROMPT = "Describe the image."


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def queued_message(redis: Any, job_id: str) -> tuple[str, bytes]:
    for name in redis.scan_iter(match=keys.queue_pattern()):
        for raw in redis.lrange(name, 0, -1):
            if message_job_id(raw) == job_id:
                return name.decode(), raw
    raise AssertionError(f"no queued message for {job_id}")


def test_a_job_whose_message_is_lost_is_resent_once_after_the_grace(redis_url: str, redis_client, tmp_path) -> None:
    settings = Settings(broker_url=redis_url, storage_url=f"file://{tmp_path}", visibility_timeout=10,
                        orphan_grace=5)
    clock = Clock()
    sweeper = OrphanSweeper(redis_client, settings, "unit", clock=clock)
    with Client(settings=settings) as client:
        lost, kept, ended = (client.submit(png(64, 64, i), PROMPT, priority=p) for i, p in ((1, 3), (2, 5), (3, 5)))
        for job in (lost, ended):  # their messages are gone; their records still say queued
            name, raw = queued_message(redis_client, job.id)
            redis_client.lrem(name, 0, raw)
        redis_client.hset(keys.job(ended.id), "status", "finished")  # and `ended` ends before the grace is up
        assert sweeper.sweep() == 0 and not redis_client.exists(keys.orphans_seen())  # too young to be due
        redis_client.delete(keys.orphan_lock())
        clock.now += 16
        assert sweeper.sweep() == 0  # missing once: noted, not re-sent (a message may be between structures)
        assert set(redis_client.hkeys(keys.orphans_seen())) == {lost.id.encode()}
        redis_client.delete(keys.orphan_lock())
        clock.now += 14
        assert sweeper.sweep() == 0, "re-sent before the visibility timeout plus the grace"
        redis_client.delete(keys.orphan_lock())
        clock.now += 1
        assert sweeper.sweep() == 1
        assert sweeper.sweep() is None  # one sweep per period across the fleet
        assert message_ids(redis_client) >= {lost.id, kept.id}
        again_name, again = queued_message(redis_client, lost.id)
        assert again_name == keys.priority_list(keys.queue("tiny-shapes", lost.info()["cost_class"]), 3)
        assert json.loads(again)["properties"]["delivery_info"]["routing_key"] == keys.shared_queue(again_name[:-2])
        assert lost.info()["resent"] == "1" and lost.status() is JobStatus.QUEUED
        assert lost.info()["queue"] == keys.queue("tiny-shapes", lost.info()["cost_class"])
        assert "resent" not in kept.info() and "resent" not in ended.info()
        assert orphans_resent(redis_client) == 1
        redis_client.delete(keys.orphan_lock())
        clock.now += 60
        assert sweeper.sweep() == 0, "a job whose message is back must not be re-sent again"


def test_a_running_job_whose_unacked_entry_is_deleted_finishes_exactly_once(
        redis_url: str, redis_client, s3_server, s3_storage_url: str, tmp_path: Path) -> None:
    settings = Settings(broker_url=redis_url, storage_url=s3_storage_url, s3_endpoint_url=s3_server.url,
                        visibility_timeout=4, orphan_grace=1, worker_batch=4)
    workers = [WorkerProcess(settings, tmp_path / "w1.log", "--name", "w1", entry=(SLOW_WORKER, "600"))]
    try:
        with Client(settings=settings) as client:
            job = client.submit(png(96, 80, 1), PROMPT, max_new_tokens=32, ignore_eos=True)
            wait_status(job, JobStatus.STARTED, timeout=180)
            tags = [tag for tag, raw in redis_client.hgetall(keys.UNACKED).items()
                    if message_job_id(json.loads(raw)[0]) == job.id]
            assert len(tags) == 1
            redis_client.hdel(keys.UNACKED, tags[0])  # lost by a path nobody foresaw, while the job runs
            workers[0].proc.send_signal(signal.SIGKILL)  # and its worker dies: no restore can bring it back
            workers[0].proc.wait()
            workers.append(WorkerProcess(settings, tmp_path / "w2.log", "--name", "w2"))
            result = job.result(timeout=120)
            assert len(result.token_ids) == 32 and result.worker == "w2" and job.status() is JobStatus.FINISHED
            info = job.info()
            assert info["resent"] == "1" and info["attempts"] == "2" and orphans_resent(redis_client) == 1
            assert redis_client.hlen(keys.UNACKED) == 0 and client.queue_depth("tiny-shapes", info["cost_class"]) == 0
            prefix = s3_storage_url.split("/", 3)[3]
            listed = client.storage.client.list_objects_v2(Bucket="vlmq-test", Prefix=f"{prefix}/results/")
            assert listed["KeyCount"] == 1
            assert workers[1].log().count(f"job {job.id} finished") == 1
            time.sleep(2 * settings.visibility_timeout)  # later sweeps find its message acked and the job ended
            assert orphans_resent(redis_client) == 1 and job.info()["resent"] == "1"
    finally:
        for w in workers:
            w.stop()
