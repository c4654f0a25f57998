"""Object-store retention (``VLMQ_RETENTION``): old inputs and results go, fresh ones and live jobs' inputs stay."""
from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import inputs
import pytest
from workerproc import TINY_CLASSES, WorkerProcess

from vlmq import keys
from vlmq.client import Client
from vlmq.jobs import JobStatus
from vlmq.settings import Settings
from vlmq.storage import FileStorage, Storage
from vlmq.store import transition
from vlmq.workers.retention import RetentionSweeper

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
PROMPT = "Describe the image."
HOUR = 3600


def image(red: int, size: tuple[int, int] = (96, 80)) -> bytes:
    return inputs.encode(inputs.rgb(*size).point(lambda v: (v + red) % 256), "PNG")


def stored(storage: Storage) -> set[str]:
    """Every object under the swept prefixes and one that is never swept."""
    future = time.time() + HOUR
    return {key for prefix in (*keys.RETAINED_PREFIXES, "kv/") for key in storage.list_older(prefix, future)}


def result(name: str, tenant: str | None = None) -> str:
    """A result object's key for a made-up job id (``name`` digits as hex)."""
    return keys.result_object(keys.tenant_job_id(tenant, name.encode().hex().ljust(32, "0")[:32]))


def orphan(name: str, tenant: str | None = None) -> str:
    """An input object's key for made-up content."""
    return keys.input_object(name.encode().hex().ljust(64, "0")[:64], tenant)


def next_second() -> float:
    """Wait for the next whole second and return it: S3 stamps objects to the second."""
    boundary = float(int(time.time()) + 1)
    while time.time() < boundary:
        time.sleep(0.02)
    return boundary


def test_sweep_deletes_old_objects_and_keeps_fresh_ones_and_live_jobs_inputs(
        redis_url: str, redis_client, s3_server, s3_storage_url: str) -> None:
    settings = Settings(broker_url=redis_url, storage_url=s3_storage_url, s3_endpoint_url=s3_server.url)
    with Client(settings=settings) as client:
        storage = client.storage
        queued, started, finished = (client.submit(image(i), PROMPT) for i in (1, 2, 3))
        transition(redis_client, started.id, [JobStatus.QUEUED], JobStatus.STARTED)
        transition(redis_client, finished.id, [JobStatus.QUEUED], JobStatus.FINISHED)
        doomed = {result("old"), orphan("orphan"), result("old", "acme"), orphan("orphan", "acme")}
        for key in (*doomed, "kv/tiny/prefix", "inputs/not-an-input"):
            storage.put(key, b"old")
        boundary = next_second()  # everything above is older than everything below
        for key in (result("new"), orphan("new"), result("new", "acme")):
            storage.put(key, b"new")
        before = stored(storage)
        sweeper = RetentionSweeper(redis_client, storage, HOUR, "w1", clock=lambda: boundary + HOUR)
        assert sweeper.sweep() == 5
        input_of = {job.id: job.info()["input_key"] for job in (queued, started, finished)}
        assert before - stored(storage) == doomed | {input_of[finished.id]}
        assert {input_of[queued.id], input_of[started.id], "kv/tiny/prefix", "inputs/not-an-input", result("new"),
                orphan("new"), result("new", "acme")} <= stored(storage)


def test_one_sweep_per_period_across_the_fleet(redis_client, tmp_path: Path) -> None:
    storage = FileStorage(tmp_path)
    storage.put(result("a"), b"x")
    os.utime(tmp_path / result("a"), (time.time() - 2 * HOUR,) * 2)
    first = RetentionSweeper(redis_client, storage, HOUR, "w1", period=1)
    second = RetentionSweeper(redis_client, storage, HOUR, "w2", period=1)
    assert first.sweep() == 1
    assert second.sweep() is None, "another worker swept this period"
    assert redis_client.get(keys.retention_lock()) == b"w1" and 0 < redis_client.ttl(keys.retention_lock()) <= 1
    deadline = time.monotonic() + 10
    while (swept := second.sweep()) is None:  # the lock expires after one period
        assert time.monotonic() < deadline, "the lock never expired"
        time.sleep(0.05)
    assert swept == 0 and not storage.exists(result("a"))


def age_everything(root: Path, seconds: float) -> None:
    old = time.time() - seconds
    for path in root.rglob("*"):
        if path.is_file():
            os.utime(path, (old, old))


@pytest.fixture
def file_settings(redis_url: str, redis_client, tmp_path: Path) -> Settings:
    # the worker takes xs jobs only: an m job stays queued for the whole test
    return Settings(broker_url=redis_url, storage_url=f"file://{tmp_path / 'store'}", cost_classes=TINY_CLASSES,
                    worker_classes="xs", kv_archive=0)  # the KV archive's objects are not the retention's business


def test_a_worker_with_retention_set_sweeps_at_start(file_settings: Settings, tmp_path: Path) -> None:
    file_settings = dataclasses.replace(file_settings, retention=HOUR)
    root = tmp_path / "store"
    with Client(settings=file_settings) as client:
        waiting = client.submit(image(7, (1000, 1000)), PROMPT)
        assert waiting.info()["cost_class"] == "m"
        client.storage.put(result("gone"), b"{}")
        client.storage.put(orphan("gone"), b"x")
        age_everything(root, 2 * HOUR)
        client.storage.put(result("fresh"), b"{}")
        worker = WorkerProcess(file_settings, tmp_path / "worker.log")
        try:
            deadline = time.monotonic() + 180
            while "retention sweep: deleted" not in worker.log():
                assert worker.alive() and time.monotonic() < deadline, worker.log()[-3000:]
                time.sleep(0.1)
        finally:
            worker.stop()
        assert stored(client.storage) == {waiting.info()["input_key"], result("fresh")}
        assert waiting.status() is JobStatus.QUEUED


def test_by_default_nothing_is_deleted(file_settings: Settings, tmp_path: Path) -> None:
    root = tmp_path / "store"
    with Client(settings=file_settings) as client:
        client.storage.put(result("ancient"), b"{}")
        client.storage.put(orphan("ancient"), b"x")
        age_everything(root, 10 * 365 * 24 * HOUR)
        worker = WorkerProcess(file_settings, tmp_path / "worker.log")
        try:
            job = client.submit(image(9), PROMPT, max_new_tokens=4)
            job.result(timeout=300)  # the worker has been up long enough for a first sweep
        finally:
            worker.stop()
        assert {result("ancient"), orphan("ancient"), keys.result_object(job.id)} <= stored(client.storage)
        assert "retention" not in worker.log()


def test_every_image_of_a_live_chat_job_is_kept(redis_url: str, redis_client, tmp_path: Path) -> None:
    settings = Settings(broker_url=redis_url, storage_url=(tmp_path / "store").as_uri())

    def chat(*reds: int) -> list[dict]:
        parts = [{"type": "image_url", "image_url": {"url": str(tmp_path / f"{red}.png")}} for red in reds]
        return [{"role": "user", "content": [*parts, {"type": "text", "text": PROMPT}]}]

    for red in (4, 5, 6, 7):
        (tmp_path / f"{red}.png").write_bytes(image(red))
    with Client(settings=settings) as client:
        live, done = client.submit(messages=chat(4, 5)), client.submit(messages=chat(6, 7))
        transition(redis_client, done.id, [JobStatus.QUEUED], JobStatus.FINISHED)
        later = time.time() + 2 * HOUR
        assert RetentionSweeper(redis_client, client.storage, HOUR, "w1", clock=lambda: later).sweep() == 2
        kept, gone = (set(json.loads(job.info()["input_keys"])) for job in (live, done))
        assert len(kept) == len(gone) == 2 and kept <= stored(client.storage) and not gone & stored(client.storage)
