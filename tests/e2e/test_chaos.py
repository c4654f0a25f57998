"""Fault injection: 300 jobs through three workers that are SIGKILLed and restarted mid-batch."""
from __future__ import annotations

import base64
import json
import random
import signal
import time
from pathlib import Path

import pytest
from test_pool import png
from workerproc import WorkerProcess

from vlmq import keys
from vlmq.client import Client
from vlmq.errors import JobTimeout
from vlmq.jobs import JobStatus
from vlmq.settings import Settings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
NUM_JOBS, NUM_WORKERS, NUM_KILLS = 300, 3, 8
KILL_PHASE_S = 300
MIN_BATCH_S = 1.0  # each batch lasts at least this long (slowworker.py), so a kill can land mid-batch
SLOW_WORKER = str(Path(__file__).with_name("slowworker.py"))


def test_every_job_finishes_exactly_once_while_workers_are_killed(redis_url: str, s3_server, tmp_path: Path) -> None:
    import redis

    redis.Redis.from_url(redis_url).flushdb()
    prefix = f"chaos-{int(time.time())}"
    settings = Settings(broker_url=redis_url, storage_url=f"s3://vlmq-test/{prefix}", s3_endpoint_url=s3_server.url,
                        visibility_timeout=6, max_attempts=50, worker_batch=8)
    rng = random.Random(7)

    def start(i: int, generation: int) -> WorkerProcess:
        return WorkerProcess(settings, tmp_path / f"w{i}-{generation}.log", "--name", f"w{i}",
                             entry=(SLOW_WORKER, str(MIN_BATCH_S)))

    workers = [start(i, 0) for i in range(NUM_WORKERS)]
    kills, caught = 0, set()
    try:
        with Client(settings=settings) as client:
            jobs = client.submit_many([{"image": png(96 + i % 5 * 40, 80, i), "prompt": "Describe the image.",
                                        "max_new_tokens": 48, "ignore_eos": True} for i in range(NUM_JOBS)])
            for w in workers:
                w.wait_ready()
            # Kill a worker only while the records say it is running jobs, so every kill lands mid-batch; the jobs
            # it held must come back and finish. Batches last at least MIN_BATCH_S, so there is time to catch one.
            deadline = time.monotonic() + KILL_PHASE_S
            while kills < NUM_KILLS and time.monotonic() < deadline:
                time.sleep(rng.uniform(0.5, 3))
                running = _running_on(client, jobs)
                busy = [i for i, w in enumerate(workers) if w.alive() and running.get(f"w{i}")]
                if not busy:
                    if all(job.status() == JobStatus.FINISHED for job in jobs):
                        break
                    continue
                i = rng.choice(busy)
                workers[i].proc.send_signal(signal.SIGKILL)  # mid-batch: its held messages are unacked
                workers[i].proc.wait()
                caught.update(j.id for j in running[f"w{i}"] if j.status() is JobStatus.STARTED)
                kills += 1
                workers[i] = start(i, kills)
            try:
                results = [job.result(timeout=900) for job in jobs]
            except JobTimeout:
                pytest.fail(_whereabouts(client, jobs, workers, tmp_path))
            assert {job.status() for job in jobs} == {JobStatus.FINISHED}
            assert all(len(r.token_ids) == 48 for r in results)
            listed = client.storage.client.list_objects_v2(Bucket="vlmq-test", Prefix=f"{prefix}/results/")
            assert listed["KeyCount"] == NUM_JOBS  # one result object per job, none extra
            assert caught, f"none of {kills} kills caught a job mid-batch"
            attempts = {job.id: int(job.info()["attempts"]) for job in jobs}
            assert all(attempts[j] >= 2 for j in caught), "a job killed mid-batch was not delivered again"
            assert client.redis.hlen(keys.UNACKED) == 0
            assert sum(client.queue_depth("tiny-shapes", c) for c in ("xs", "s")) == 0
    finally:
        for w in workers:
            w.stop()


def _running_on(client: Client, jobs: list) -> dict[str, list]:
    """Worker name -> the jobs its records say it is running now."""
    pipe = client.redis.pipeline(transaction=False)
    for job in jobs:
        pipe.hmget(keys.job(job.id), "status", "worker")
    running: dict[str, list] = {}
    for job, (status, worker) in zip(jobs, pipe.execute(), strict=True):
        if status == b"started" and worker:
            running.setdefault(worker.decode(), []).append(job)
    return running


def _whereabouts(client: Client, jobs: list, workers: list[WorkerProcess], tmp_path: Path) -> str:
    """For each unfinished job: its record, whether its message is queued or unacked, and the log lines naming it."""
    r = client.redis
    queues = [k for c in ("xs", "s") for k in keys.queue_lists(keys.queue("tiny-shapes", c))]
    messages = [m for key in queues for m in r.lrange(key, 0, -1)] + r.hvals(keys.UNACKED)
    lines = []
    for job in jobs:
        if job.status() == JobStatus.FINISHED:
            continue
        held = [m for m in messages if job.id.encode() in _body(m)]
        logs = [ln for f in sorted(tmp_path.glob("*.log")) for ln in f.read_text(errors="replace").splitlines()
                if job.id in ln]
        lines.append(f"{job.id}: {job.info()}; messages holding it: {len(held)}; log: {logs}")
    alive = [w.alive() for w in workers]
    return f"{len(lines)} jobs unfinished (workers alive: {alive}):\n" + "\n".join(lines[:20])


def _body(stored: bytes) -> bytes:
    message = json.loads(stored)  # a queued message, or an unacked entry [message, exchange, routing_key]
    return base64.b64decode((message[0] if isinstance(message, list) else message)["body"])
