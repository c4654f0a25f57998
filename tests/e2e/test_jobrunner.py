"""run_job on its own: a real Valkey and file storage, an in-memory backend instead of a model.

The worker-level tests see jobs through subprocess logs; these call the adapter between job records and the
backend directly and check what a user would then read from the job.
"""
from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from vlmq import keys
from vlmq.client import Client
from vlmq.errors import InvalidRequest, JobFailed
from vlmq.jobs import Job, JobStatus
from vlmq.settings import Settings
from vlmq.workers.backends.base import Backend, GenOutput, GenRequest
from vlmq.workers.batcher import Batcher
from vlmq.workers.jobrunner import WorkerContext, hand_back, run_job


class EchoBackend(Backend):
    """Answers every request with its prompt; a prompt naming a failure gets that failure in its slot."""

    model_dir = "in-memory"

    def __init__(self) -> None:
        self.seen: list[GenRequest] = []

    def generate(self, requests: list[GenRequest]) -> list[GenOutput | Exception]:
        self.seen += requests
        return [self._one(r) for r in requests]

    @staticmethod
    def _one(r: GenRequest) -> GenOutput | Exception:
        if "too long" in r.prompt:
            return InvalidRequest("prompt and image exceed the KV budget", code="request_too_long")
        if "crash" in r.prompt:
            return RuntimeError("device fell over")
        image = r.image if r.image is not None else (r.images[0] if r.images else None)  # a chat: its first image
        return GenOutput(f"echo: {r.prompt}", list(range(r.max_new_tokens)), "length", 7,
                         image.width if image is not None else 0)


def png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 30, 30)).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture
def pool(redis_url: str, redis_client: Any, tmp_path: Path) -> Iterator[tuple[Client, WorkerContext, EchoBackend]]:
    settings = Settings(broker_url=redis_url, storage_url=f"file://{tmp_path}/store", max_attempts=2)
    backend = EchoBackend()
    with Client(settings=settings) as client:
        yield client, WorkerContext(settings, client.redis, client.storage, Batcher(backend, 4), "tiny-shapes",
                                    "unit"), backend


def failure(job: Job) -> JobFailed:
    with pytest.raises(JobFailed) as err:
        job.result(timeout=1)
    return err.value


def test_a_job_is_served_and_its_result_is_what_the_backend_said(pool) -> None:
    client, ctx, backend = pool
    job = client.submit(png(), "What colour?", max_new_tokens=5)
    assert run_job(ctx, job.id) == "finished"
    result = job.result(timeout=1)
    assert (result.text, result.token_ids, result.worker) == ("echo: What colour?", [0, 1, 2, 3, 4], "unit")
    assert backend.seen[0].image.size == (64, 48) and job.info()["attempts"] == "1"


def test_sampling_reaches_the_backend_and_the_result_says_what_was_applied(pool) -> None:
    client, ctx, backend = pool
    sampled = client.submit(png(), "What colour?", temperature=0.7, seed=3)
    greedy = client.submit(png(), "What colour?", seed=3)  # a seed without a temperature: greedy, seed unused
    old = client.submit(png(), "What colour?")
    client.redis.hdel(keys.job(old.id), "temperature", "seed")  # a record from before sampling existed
    assert [run_job(ctx, job.id) for job in (sampled, greedy, old)] == ["finished"] * 3
    assert [(r.temperature, r.seed) for r in backend.seen] == [(0.7, 3), (0.0, None), (0.0, None)]
    assert sampled.result(timeout=1).raw["sampling"] == {"temperature": 0.7, "seed": 3}
    assert greedy.result(timeout=1).raw["sampling"] == {"temperature": 0.0, "seed": None}


@pytest.mark.parametrize(("prompt", "code", "retryable"), [("too long", "request_too_long", False),
                                                           ("crash", "model_error", True)])
def test_a_backend_failure_fails_that_job_with_its_code(pool, prompt: str, code: str, retryable: bool) -> None:
    client, ctx, _ = pool
    job = client.submit(png(), prompt)
    assert run_job(ctx, job.id) == "failed"
    err = failure(job)
    assert (err.error_type, err.retryable) == (code, retryable)


@pytest.mark.parametrize(("field", "value", "code"), [("max_new_tokens", "3000", "bad_max_new_tokens"),
                                                      ("status", "bogus", "bad_record"),
                                                      ("input_key", "results/other.json", "bad_input_key"),
                                                      ("prompt", "<|image_pad|>", "bad_prompt"),
                                                      ("temperature", "2.5", "bad_temperature"),
                                                      ("seed", "-1", "bad_seed")])
def test_a_forged_record_fails_alone_and_never_reaches_the_backend(pool, field: str, value: str, code: str) -> None:
    client, ctx, backend = pool
    job = client.submit(png(), "What colour?")
    client.redis.hset(keys.job(job.id), field, value)
    assert run_job(ctx, job.id) == "failed"
    err = failure(job)
    assert (err.error_type, err.retryable) == (code, False) and job.status() is JobStatus.FAILED
    assert backend.seen == []


def test_an_input_that_does_not_hash_to_its_address_fails_its_job_alone(pool) -> None:
    # issue 36 item 4: other bytes at inputs/<sha256> (anyone who can write the bucket) must not be served
    client, ctx, backend = pool
    job = client.submit(png(), "What colour?")
    client.storage.put(job.info()["input_key"], png()[:-1] + b"\x00")
    assert run_job(ctx, job.id) == "failed"
    err = failure(job)
    assert (err.error_type, err.retryable) == ("input_corrupt", False) and backend.seen == []
    again = client.submit(png(), "What colour?")  # the SDK writes the bytes again; the job is served
    assert run_job(ctx, again.id) == "finished" and len(backend.seen) == 1


def test_missing_input_canceled_jobs_and_poison(pool) -> None:
    client, ctx, backend = pool
    gone = client.submit(png(), "What colour?")
    client.storage.delete(gone.info()["input_key"])
    assert run_job(ctx, gone.id) == "failed" and failure(gone).error_type == "input_missing"
    canceled = client.submit(png(), "What colour?")
    canceled.cancel()
    assert run_job(ctx, canceled.id) == "canceled"
    looping = client.submit(png(), "What colour?")
    client.redis.hset(keys.job(looping.id), "attempts", ctx.settings.max_attempts)  # every delivery crashed
    assert run_job(ctx, looping.id) == "failed" and failure(looping).error_type == "poison"
    assert backend.seen == [] and run_job(ctx, "f" * 32) == "missing"


def test_a_handed_back_job_is_queued_again_and_not_counted_as_a_crash(pool) -> None:
    client, ctx, _ = pool
    job = client.submit(png(), "What colour?")
    client.redis.hset(keys.job(job.id), mapping={"status": "started", "attempts": 1})
    hand_back(ctx, job.id)
    assert job.status() is JobStatus.QUEUED and job.info()["attempts"] == "0"


def test_a_job_canceled_while_its_result_is_written_has_no_result(pool) -> None:
    client, ctx, _ = pool
    job = client.submit(png(), "hello", max_new_tokens=3)
    put_if_absent = ctx.storage.put_if_absent

    def cancel_then_write(key: str, data: bytes) -> bool:  # the user cancels in the window after the worker's check
        assert job.cancel()
        return put_if_absent(key, data)

    ctx.storage.put_if_absent = cancel_then_write  # type: ignore[method-assign]
    assert run_job(ctx, job.id) == "canceled"
    assert job.status() is JobStatus.CANCELED
    assert not client.storage.exists(keys.result_object(job.id))
