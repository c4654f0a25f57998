"""Cache-affinity routing end to end: two real worker processes over Valkey and the S3-compatible server.

16 images x 8 questions arrive interleaved (each image's first question, then the other seven rounds). With
affinity every image is encoded once fleet-wide, counted from the workers' published counters; without it the
second round onwards lands on either worker, so images are encoded on both. Killing the worker that holds the
hot images mid-run loses no job: its own queue drains back to the shared queue.
"""
from __future__ import annotations

import dataclasses
import signal
import time
from collections import Counter
from collections.abc import Iterator

import pytest
from test_pool import png
from workerproc import TINY_CLASSES, WorkerProcess

from vlmq import affinity, keys
from vlmq.client import Client
from vlmq.jobs import Job, JobStatus
from vlmq.settings import Settings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
MODEL = "tiny-shapes"
NUM_IMAGES, NUM_QUESTIONS = 16, 8
QUESTIONS = ["How many shapes?", "What colour is the circle?", "Is there a square?", "Describe the image.",
             "Where is the triangle?", "What is the largest shape?", "Any red shapes?", "Name one shape."]


@pytest.fixture(scope="module")
def fleet(redis_url: str, s3_server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Settings, dict]]:
    import redis

    redis.Redis.from_url(redis_url).flushdb()
    # a short heartbeat and visibility timeout, so a killed worker's queue and in-flight jobs come back quickly;
    # a bound above what one worker is sent here, so routing alone decides where jobs run
    settings = Settings(broker_url=redis_url, storage_url=f"s3://vlmq-test/affinity-{int(time.time())}",
                        s3_endpoint_url=s3_server.url, cost_classes=TINY_CLASSES, affinity_ttl=3,
                        visibility_timeout=10, affinity_queue_bound=NUM_IMAGES * NUM_QUESTIONS,
                        kv_archive=0)  # the shared archive would also save encodes: this counts routing's effect
    log_dir = tmp_path_factory.mktemp("affinity")
    workers = {name: WorkerProcess(settings, log_dir / f"{name}.log", "--name", name) for name in ("wa", "wb")}
    try:
        for worker in workers.values():
            worker.wait_ready()
        yield settings, workers
    finally:
        for worker in workers.values():
            worker.stop()


def encoded_images(client: Client) -> int:
    return client.cache_stats()["models"][MODEL]["counters"]["encoded_images"]


def run_interleaved(client: Client, first_seed: int, num_images: int = NUM_IMAGES) -> list[Job]:
    """Each image's first question (waited for), then the other rounds, image after image within each round."""
    images = [png(320, 240, first_seed + i) for i in range(num_images)]
    jobs = client.submit_many([{"image": im, "prompt": QUESTIONS[0], "max_new_tokens": 2} for im in images])
    for job in jobs:
        job.result(timeout=120)
    rest = [{"image": im, "prompt": q, "max_new_tokens": 2} for q in QUESTIONS[1:] for im in images]
    return jobs + client.submit_many(rest)


def finish_all(jobs: list[Job]) -> Counter[str]:
    """Every job's result; returns which worker served how many."""
    return Counter(job.result(timeout=120).worker for job in jobs)


def test_with_affinity_every_image_is_encoded_once_fleet_wide(fleet: tuple[Settings, dict]) -> None:
    settings, _ = fleet
    with Client(settings=dataclasses.replace(settings, affinity=False)) as client:
        before = encoded_images(client)
        served = finish_all(run_interleaved(client, first_seed=1000))
        without = encoded_images(client) - before
        assert set(served) == {"wa", "wb"}, served
    with Client(settings=settings) as client:
        before = encoded_images(client)
        jobs = run_interleaved(client, first_seed=2000)
        routed = Counter(job.info()["queue"] for job in jobs[NUM_IMAGES:])
        served = finish_all(jobs)
        with_affinity = encoded_images(client) - before
        stats = client.cache_stats()
    assert with_affinity == NUM_IMAGES, (with_affinity, routed, served)
    assert without > NUM_IMAGES, without  # the same image was encoded on both workers
    # every later question went to a worker's own queue
    assert set(routed) == {keys.worker_queue(MODEL, "xs", w) for w in ("wa", "wb")}, routed
    assert sum(routed.values()) == NUM_IMAGES * (NUM_QUESTIONS - 1)
    # the later questions reuse the image's prefix KV (the encoder is not even asked for it)
    rates = stats["models"][MODEL]["hit_rates"]
    assert set(rates) >= {"encoder_cache", "prefix_cache"} and rates["prefix_cache"] > 0.3, rates
    assert set(stats["workers"]) == {"wa", "wb"} and stats["archive"] == {}


def test_killing_the_worker_with_the_hot_images_loses_no_job(fleet: tuple[Settings, dict]) -> None:
    settings, workers = fleet
    with Client(settings=settings) as client:
        jobs = run_interleaved(client, first_seed=3000)
        routed = Counter(job.info()["queue"] for job in jobs[NUM_IMAGES:])
        victim = max(("wa", "wb"), key=lambda w: routed[keys.worker_queue(MODEL, "xs", w)])
        own = keys.worker_queue(MODEL, "xs", victim)
        # kill it while its own queue still holds jobs routed to it
        assert affinity.queue_depths(client.redis, [own])[0] > 0, routed
        workers[victim].proc.send_signal(signal.SIGKILL)
        workers[victim].proc.wait()
        served_by = [job.result(timeout=120).worker for job in jobs]
        assert all(job.status() is JobStatus.FINISHED for job in jobs)
        assert affinity.queue_depths(client.redis, [own]) == [0]
        survivor = "wb" if victim == "wa" else "wa"
        # jobs sent to the victim's own queue were served by the survivor once the queue drained back
        rescued = [j for j, w in zip(jobs, served_by, strict=True) if w == survivor and j.info()["queue"] == own]
    assert rescued, (routed, Counter(served_by))
    assert "back to the shared queues" in workers[survivor].log()
