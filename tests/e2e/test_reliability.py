"""Nothing lost, nothing done twice: leases, redelivery, poison jobs, cancellation, outages, shutdown."""
from __future__ import annotations

import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from proxy import Proxy
from test_pool import png
from workerproc import WorkerProcess

from vlmq import keys
from vlmq.client import Client
from vlmq.embedded import start_valkey
from vlmq.errors import JobFailed
from vlmq.jobs import JobStatus
from vlmq.settings import Settings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
PROMPT = "Describe the image."
SLOW_WORKER = str(Path(__file__).with_name("slowworker.py"))


@pytest.fixture
def settings(redis_url: str, s3_server, s3_storage_url: str) -> Settings:
    import redis

    redis.Redis.from_url(redis_url).flushdb()
    return Settings(broker_url=redis_url, storage_url=s3_storage_url, s3_endpoint_url=s3_server.url,
                    visibility_timeout=4, worker_batch=4)


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[list[WorkerProcess]]:
    started: list[WorkerProcess] = []
    yield started
    for w in started:
        w.stop()


def start(workers: list[WorkerProcess], settings: Settings, tmp_path: Path, name: str,
          min_batch_s: float = 0) -> WorkerProcess:
    """A worker; with ``min_batch_s`` each of its batches lasts at least that long, however fast the backend."""
    entry = (SLOW_WORKER, str(min_batch_s)) if min_batch_s else ("-m", "vlmq.workers.main")
    w = WorkerProcess(settings, tmp_path / f"{name}-{len(workers)}.log", "--name", name, entry=entry)
    workers.append(w)
    return w


def long_job(client: Client, seed: int = 0, tokens: int = 1024):
    return client.submit(png(160, 120, seed), PROMPT, max_new_tokens=tokens, ignore_eos=True)


def wait_status(job, status: JobStatus, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while job.status() is not status:
        assert time.monotonic() < deadline, f"{job} still {job.status()} (wanted {status})"
        time.sleep(0.05)


def test_a_batch_longer_than_the_visibility_timeout_runs_once(settings: Settings, workers, tmp_path: Path) -> None:
    # Batches last 3 visibility timeouts even on a fast backend: only lease renewal keeps their messages hidden.
    slow = 3 * settings.visibility_timeout
    a, b = start(workers, settings, tmp_path, "a", slow), start(workers, settings, tmp_path, "b", slow)
    a.wait_ready(), b.wait_ready()
    with Client(settings=settings) as client:
        jobs = [long_job(client, i) for i in range(2)]
        results = [j.result(timeout=600) for j in jobs]
        for job, result in zip(jobs, results, strict=True):
            assert len(result.token_ids) == 1024
            assert result.timings["model"] > 2 * settings.visibility_timeout, "the job must outlive the timeout"
            assert job.info()["attempts"] == "1", "a healthy worker's job was delivered twice"


def test_killed_worker_jobs_come_back_and_poison_jobs_stop(settings: Settings, workers, tmp_path: Path) -> None:
    settings.max_attempts = 2
    with Client(settings=settings) as client:
        job = long_job(client)
        for attempt in (1, 2):
            w = start(workers, settings, tmp_path, f"crash{attempt}", min_batch_s=600)  # still mid-batch when killed
            wait_status(job, JobStatus.STARTED, timeout=180)
            assert job.info()["attempts"] == str(attempt)
            w.proc.send_signal(signal.SIGKILL)  # mid-batch, as an OOM kill would
            w.proc.wait()
            client.redis.hset(keys.job(job.id), "status", "queued")  # let wait_status see the next start
        survivor = start(workers, settings, tmp_path, "survivor")
        with pytest.raises(JobFailed) as err:
            job.result(timeout=300)
        assert err.value.error_type == "poison" and not err.value.retryable
        assert job.info()["attempts"] == "3"
        assert not client.storage.exists(keys.result_object(job.id))
        # the worker carries on with other jobs
        assert client.submit(png(100, 100, 5), PROMPT).result(timeout=300).finish_reason in ("stop", "length")
        assert survivor.alive()


def test_sigkilled_worker_job_is_finished_by_another_worker(settings: Settings, workers, tmp_path: Path) -> None:
    with Client(settings=settings) as client:
        victim = start(workers, settings, tmp_path, "victim", min_batch_s=600)  # still mid-batch when killed
        job = long_job(client, tokens=512)
        wait_status(job, JobStatus.STARTED, timeout=180)
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait()
        start(workers, settings, tmp_path, "rescuer")
        result = job.result(timeout=300)
        assert result.worker == "rescuer" and len(result.token_ids) == 512
        assert job.info()["attempts"] == "2"


def test_cancellation_is_durable_and_stops_running_jobs(settings: Settings, workers, tmp_path: Path) -> None:
    with Client(settings=settings) as client:
        queued = client.submit(png(100, 100, 1), PROMPT)
        assert queued.cancel()
        running = long_job(client, 2, tokens=1024)
        w = start(workers, settings, tmp_path, "w")  # starts after the cancel: must still skip the job
        wait_status(running, JobStatus.STARTED, timeout=180)
        assert running.cancel()
        after = client.submit(png(100, 100, 3), PROMPT)
        assert after.result(timeout=300).finish_reason in ("stop", "length")
        for job in (queued, running):
            assert job.status() is JobStatus.CANCELED
            assert not client.storage.exists(keys.result_object(job.id))
        assert "started_at" not in queued.info()
        stopped = re.search(rf"job {running.id} canceled while running \((\w+) after (\d+) tokens\)", w.log())
        assert stopped, "the running job was not dropped as canceled"
        assert stopped[1] == "canceled" and int(stopped[2]) < 1024, "generation went on after the cancel"
        assert w.alive()


def test_object_store_outage_delays_jobs_without_losing_them(settings: Settings, s3_server, workers,
                                                              tmp_path: Path) -> None:
    proxy = Proxy(s3_server.port)
    proxy.start()
    settings.s3_endpoint_url = proxy.url
    with Client(settings=settings) as client:
        jobs = [client.submit(png(120, 100, i), PROMPT) for i in range(4)]
        proxy.cut()
        w = start(workers, settings, tmp_path, "w")
        w.wait_ready()
        # the worker takes every job and keeps retrying the store: wait for that, then check none ended
        deadline = time.monotonic() + 180
        while not ("object store failed" in w.log() and all(j.status() is JobStatus.STARTED for j in jobs)):
            assert time.monotonic() < deadline, f"jobs {[j.status() for j in jobs]} during the outage"
            time.sleep(0.05)
        assert not any(j.status().is_final for j in jobs)
        proxy.start()
        for job in jobs:
            assert job.result(timeout=300).finish_reason in ("stop", "length")
            assert job.info()["attempts"] == "1", "an outage must not count as a crash"


def test_workers_reconnect_after_a_redis_restart(s3_server, s3_storage_url: str, workers, tmp_path: Path) -> None:
    server = start_valkey()
    try:
        settings = Settings(broker_url=server.url, storage_url=s3_storage_url, s3_endpoint_url=s3_server.url)
        w = start(workers, settings, tmp_path, "w")
        w.wait_ready()
        with Client(settings=settings) as client:
            assert client.submit(png(100, 100, 1), PROMPT).result(timeout=300).finish_reason in ("stop", "length")
        server.stop()
        time.sleep(3)
        server = start_valkey(server.port)
        with Client(settings=settings) as client:
            assert client.submit(png(100, 100, 2), PROMPT).result(timeout=300).finish_reason in ("stop", "length")
        assert w.alive()
    finally:
        server.stop()


def test_sigterm_hands_unfinished_jobs_to_other_workers_at_once(settings: Settings, workers, tmp_path: Path) -> None:
    settings.visibility_timeout = 600  # the rescue below must not come from the timeout sweep
    settings.shutdown_grace = 2
    with Client(settings=settings) as client:
        leaving = start(workers, settings, tmp_path, "leaving", min_batch_s=600)  # mid-batch at the SIGTERM
        jobs = [long_job(client, i, tokens=1024) for i in range(2)]
        for job in jobs:
            wait_status(job, JobStatus.STARTED, timeout=180)
        stayer = start(workers, settings, tmp_path, "stayer")
        stayer.wait_ready()
        t0 = time.monotonic()
        leaving.proc.send_signal(signal.SIGTERM)
        assert leaving.proc.wait(timeout=60) is not None
        for job in jobs:
            result = job.result(timeout=300)
            assert result.worker == "stayer"
        assert time.monotonic() - t0 < 300 < settings.visibility_timeout
