"""A job's priority reaches the engine: a high-priority job submitted behind a long low-priority queue on one
worker overtakes the low-priority jobs the worker already holds, not only those still in Redis."""
from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_pool import png
from workerproc import TINY_CLASSES, WorkerProcess

from vlmq.client import Client
from vlmq.jobs import JobStatus
from vlmq.settings import Settings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
NARROW_WORKER = str(Path(__file__).with_name("narrowworker.py"))
HELD = 8  # jobs the worker holds at once (VLMQ_WORKER_BATCH); its engine runs one of them at a time
NUM_LOW = 2 * HELD
TOKENS = 16
LOW_TOKENS = 384  # long enough that the high-priority job is prepared while one low-priority job runs


@pytest.fixture
def worker(redis_url: str, s3_server, s3_storage_url: str, tmp_path: Path) -> Iterator[Settings]:
    import redis

    redis.Redis.from_url(redis_url).flushdb()
    settings = Settings(broker_url=redis_url, storage_url=s3_storage_url, s3_endpoint_url=s3_server.url,
                        cost_classes=TINY_CLASSES, worker_batch=HELD)
    w = WorkerProcess(settings, tmp_path / "worker.log", "--name", "narrow", entry=(NARROW_WORKER, "1"))
    try:
        w.wait_ready()
        yield settings
    finally:
        w.stop()


def wait_until(check, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_high_priority_job_overtakes_the_low_priority_jobs_its_worker_holds(worker: Settings) -> None:
    with Client(settings=worker) as client:
        low = [client.submit(png(96, 80, i), "Describe the image.", max_new_tokens=LOW_TOKENS, ignore_eos=True,
                             priority=9) for i in range(NUM_LOW)]
        # the worker holds HELD low-priority jobs (one running in its engine, the rest waiting there)
        wait_until(lambda: sum(j.status() is not JobStatus.QUEUED for j in low) >= HELD, "the worker's first jobs")
        high = client.submit(png(96, 80, 99), "Describe the image.", max_new_tokens=TOKENS, ignore_eos=True,
                             priority=0)
        assert len(high.result(timeout=300).token_ids) == TOKENS
        for job in low:
            job.result(timeout=300)
        done_at = float(high.info()["finished_at"])
        before = sorted(float(j.info()["finished_at"]) for j in low if float(j.info()["finished_at"]) < done_at)
    # Ahead of it: the job running when a slot freed for it, and the one the engine started while its message was
    # fetched and prepared. Without priority in the engine, every job the worker held (HELD) would be.
    assert len(before) <= 2, (f"{len(before)} of {NUM_LOW} low-priority jobs finished before the high-priority one "
                              f"(finished {done_at - before[0]:.2f} s after the first of them)")
