"""A worker holds only what fits its budget; the rest stays in Redis for other workers."""
from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path

import pytest
from test_pool import png
from workerproc import TINY_CLASSES, WorkerProcess

from vlmq.client import Client
from vlmq.jobs import JobStatus
from vlmq.settings import Settings
from vlmq.workers import redispop

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def test_worker_reserves_only_within_its_budget(redis_url: str, s3_server, tmp_path: Path) -> None:
    import redis

    r = redis.Redis.from_url(redis_url)
    r.flushdb()
    r.script_flush()  # below: the worker popped with vlmq's atomic pop script, not kombu's BRPOP
    # with 128 text tokens a job, xs costs 64 + 128 = 192 tokens and m 1024 + 128: a 384 budget holds two xs jobs
    # and never the m job (a 1000 x 1000 image, 324 vision tokens)
    settings = Settings(broker_url=redis_url, storage_url="s3://vlmq-test/e2e-gate", s3_endpoint_url=s3_server.url,
                        cost_classes=TINY_CLASSES, text_token_bound=128, worker_budget=384)
    with Client(settings=settings) as client:
        big = client.submit(png(1000, 1000, 1), "Describe the image.")
        small = [client.submit(png(200, 150, i), "Describe the image.", max_new_tokens=32) for i in range(12)]
        held: list[int] = []
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                held.append(r.hlen("unacked"))
                time.sleep(0.005)

        watcher = threading.Thread(target=watch)
        worker = WorkerProcess(settings, tmp_path / "worker.log")
        watcher.start()
        try:
            worker.wait_ready()
            for job in small:
                job.result(timeout=600)
        finally:
            done.set()
            watcher.join()
            worker.stop()
        assert max(held) == 2, f"held at most {max(held)} messages; the budget allows 2"
        assert big.status() is JobStatus.QUEUED
        assert client.queue_depth("tiny-shapes", "m") == 1, "the m job must stay in Redis, visible to other workers"
        assert client.queue_depth("tiny-shapes", "xs") == 0
        assert r.script_exists(hashlib.sha1(redispop.POP_SCRIPT.encode()).hexdigest()) == [True]
