"""Infrastructure errors are never a job's failure: Redis or the object store going away mid-job hands the job
back (not failed, the attempt not counted), with real servers behind a proxy that can be cut."""
from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib
from proxy import Proxy
from test_jobrunner import EchoBackend, png

from vlmq.client import Client
from vlmq.embedded import start_valkey
from vlmq.errors import BackendError, HandBack, JobFailed
from vlmq.jobs import JobStatus
from vlmq.settings import Settings
from vlmq.storage import S3Storage
from vlmq.workers import faults
from vlmq.workers.backends.base import GenOutput, GenRequest
from vlmq.workers.batcher import Batcher
from vlmq.workers.jobrunner import WorkerContext, run_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


class CuttingBackend(EchoBackend):
    """Echoes, but cuts the worker's Redis connection while the model runs (the broker dies mid-job)."""

    def __init__(self, proxy: Proxy) -> None:
        super().__init__()
        self.proxy = proxy
        self.cut = True

    def generate(self, requests: list[GenRequest]) -> list[GenOutput | Exception]:
        if self.cut:
            self.proxy.cut()
        return super().generate(requests)


@pytest.fixture
def cut_pool(redis_url: str, redis_client: Any, tmp_path: Path) -> Iterator[tuple[Client, WorkerContext, Proxy]]:
    settings = Settings(broker_url=redis_url, storage_url=f"file://{tmp_path}/store", max_attempts=1)
    proxy = Proxy(int(redis_url.rsplit(":", 1)[1].split("/")[0]))
    proxy.start()
    worker_redis = redis_lib.Redis(port=proxy.port, socket_connect_timeout=1, socket_timeout=2)
    with Client(settings=settings) as client:
        backend = CuttingBackend(proxy)
        yield client, WorkerContext(settings, worker_redis, client.storage, Batcher(backend, 4), "tiny-shapes",
                                    "unit"), proxy
    proxy.cut()


def test_the_broker_going_away_as_a_job_finishes_hands_it_back_uncounted(cut_pool) -> None:
    client, ctx, proxy = cut_pool
    job = client.submit(png(), "What colour?", max_new_tokens=3)
    with pytest.raises(HandBack):
        run_job(ctx, job.id)  # _finish, and _fail before this fix, need Redis: it is gone
    from vlmq.workers.app import hand_back

    hand_back(ctx, job.id, counted=True)  # what the task does next; Redis still down: the attempt is owed
    assert ctx.owed.pending() == 1
    assert job.status() is JobStatus.STARTED  # not failed: the record waits for the message to come back
    proxy.start()
    deadline = time.monotonic() + 10
    while ctx.owed.pending() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert job.info()["attempts"] == "0", "an attempt cut short by the broker counted against max_attempts"
    ctx.batcher.backend.cut = False
    assert run_job(ctx, job.id) == "finished"  # max_attempts=1: had the attempt counted, this would be poison
    assert job.result(timeout=5).text == "echo: What colour?"


def test_infrastructure_errors_are_told_from_job_faults(tmp_path: Path) -> None:
    server = start_valkey()
    try:
        admin = redis_lib.Redis.from_url(server.url)
        admin.config_set("busy-reply-threshold", 10)  # ms a script runs before others get BUSY
        spin = threading.Thread(target=lambda: redis_lib.Redis.from_url(server.url).eval(
            "local t = redis.call('TIME'); while redis.call('TIME')[1] - t[1] < 2 do end", 0))
        spin.start()
        time.sleep(0.3)
        with pytest.raises(redis_lib.ResponseError) as busy:
            redis_lib.Redis.from_url(server.url).ping()
        spin.join()
    finally:
        server.stop()
    assert str(busy.value).startswith("BUSY") and faults.is_infra(busy.value)
    with pytest.raises(redis_lib.ConnectionError) as down:
        redis_lib.Redis.from_url(server.url, socket_connect_timeout=1).ping()
    assert faults.is_infra(down.value) and faults.is_infra(BackendError("object store unreachable"))
    for own in (JobFailed("invalid_image", "not an image"), ValueError("bad prompt"), KeyError("inputs/x"),
                redis_lib.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value")):
        assert not faults.is_infra(own), own
    try:  # a job's own fault raised while handling a connection error stays the job's
        try:
            raise redis_lib.ConnectionError("gone")
        except redis_lib.ConnectionError:
            raise ValueError("bad prompt")  # noqa: B904
    except ValueError as during:
        assert not faults.is_infra(during)


def test_a_frozen_object_store_is_an_infrastructure_error(s3_server) -> None:
    from vlmq.embedded import start_moto

    moto = start_moto()
    try:
        import boto3

        boto3.client("s3", endpoint_url=moto.url).create_bucket(Bucket="frozen")
        store = S3Storage("frozen", endpoint_url=moto.url, timeout=1)
        store.put("results/x.json", b"{}")
        moto.proc.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(BackendError) as frozen:
                store.get("results/x.json")
        finally:
            moto.proc.send_signal(signal.SIGCONT)
    finally:
        moto.stop()
    assert faults.is_infra(frozen.value)
    with pytest.raises(KeyError):
        S3Storage("vlmq-test", endpoint_url=s3_server.url).get("results/missing.json")


class FreezingBackend(EchoBackend):
    """Echoes, but freezes the object store (SIGSTOP) while the model runs: the result write meets the freeze."""

    def __init__(self, moto: Any) -> None:
        super().__init__()
        self.moto, self.freeze = moto, True

    def generate(self, requests: list[GenRequest]) -> list[GenOutput | Exception]:
        if self.freeze:
            self.moto.proc.send_signal(signal.SIGSTOP)
        return super().generate(requests)


def test_a_result_write_during_a_storage_freeze_is_retried_then_handed_back(redis_url: str, redis_client) -> None:
    import boto3

    from vlmq.embedded import start_moto
    from vlmq.workers.main import storage_timeout

    moto = start_moto()
    try:
        boto3.client("s3", endpoint_url=moto.url).create_bucket(Bucket="frozen")
        settings = Settings(broker_url=redis_url, storage_url="s3://frozen/p", s3_endpoint_url=moto.url,
                            storage_retry=4)
        storage = S3Storage("frozen", "p", endpoint_url=moto.url, timeout=storage_timeout(settings))
        backend = FreezingBackend(moto)
        ctx = WorkerContext(settings, redis_client, storage, Batcher(backend, 4), "tiny-shapes", "unit")
        with Client(settings=settings) as client:
            job = client.submit(png(), "What colour?", max_new_tokens=3)
            t0 = time.monotonic()
            try:
                with pytest.raises(HandBack, match="object store unreachable"):
                    run_job(ctx, job.id)
            finally:
                moto.proc.send_signal(signal.SIGCONT)
            assert time.monotonic() - t0 < 4 * settings.storage_retry, "the freeze held the job past the retry"
            from vlmq.workers.app import hand_back

            hand_back(ctx, job.id)
            assert job.status() is JobStatus.QUEUED and job.info()["attempts"] == "0"
            backend.freeze = False
            assert run_job(ctx, job.id) == "finished"  # a write that landed during the freeze would be kept
            assert job.result(timeout=5).text == "echo: What colour?"
    finally:
        moto.stop()
