"""The SDK against a real Redis-compatible server and file storage (no worker running)."""
from __future__ import annotations

import io
import json
import threading
import time
from pathlib import Path

import pytest
from PIL import Image

from vlmq import keys
from vlmq.client import Client
from vlmq.embedded import free_port
from vlmq.errors import BackendError, InvalidRequest, JobFailed, JobNotFound, JobTimeout, QueueFull
from vlmq.jobs import JobStatus
from vlmq.settings import Settings


def png(width: int = 100, height: int = 80, colour: tuple[int, int, int] = (255, 0, 0)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture
def client(redis_client: object, redis_url: str, tmp_path: Path) -> Client:
    with Client(redis_url, f"file://{tmp_path / 'store'}") as c:
        yield c


def _queued_messages(client: Client, queue: str) -> list[dict]:
    raw = [m for k in client.redis.keys(queue + "*") for m in client.redis.lrange(k, 0, -1)]
    return [json.loads(m) for m in raw]


def test_submit_writes_record_input_and_a_json_message_on_the_class_queue(client: Client) -> None:
    # tiny-shapes: 56-px tokens, at most 1024x1024 pixels (1008x1008 after resizing): 18 x 18 tokens, class s
    job = client.submit(png(1000, 1000), "How many circles?", max_new_tokens=10, priority=2)
    info = job.info()
    assert job.status() is JobStatus.QUEUED
    assert f"{job.status()}" == str(job.status()) == "queued"  # what print(job.status()) shows
    assert info["cost_class"] == "s" and info["queue"] == "vlmq.tiny-shapes.s"
    assert int(info["vision_tokens"]) == 18 * 18 and int(info["encoder_patches"]) == 4 * 18 * 18
    assert client.storage.get(info["input_key"]) == png(1000, 1000)
    [message] = _queued_messages(client, "vlmq.tiny-shapes.s")
    assert message["content-type"] == "application/json"
    assert message["headers"]["task"] == "vlmq.run_job"
    assert json.loads(__import__("base64").b64decode(message["body"]))[0] == [job.id]
    assert message["properties"]["priority"] == 2


def test_inputs_are_content_addressed(client: Client) -> None:
    a = client.submit(png(), "Describe the image.").info()["input_key"]
    b = client.submit(io.BytesIO(png()), "How many shapes?").info()["input_key"]
    assert a == b and a.startswith("inputs/") and len(a) == len("inputs/") + 64


def test_image_sources_path_file_object_pil_and_s3_uri(client: Client, tmp_path: Path) -> None:
    path = tmp_path / "img.png"
    path.write_bytes(png(50, 50))
    jobs = [client.submit(path, "Describe the image."), client.submit(str(path), "Describe the image."),
            client.submit(Image.new("RGB", (60, 40)), "Describe the image.")]
    assert all(j.status() is JobStatus.QUEUED for j in jobs)
    for outside in ("s3://elsewhere/img.png", f"file://{tmp_path}/img.png"):
        with pytest.raises(InvalidRequest) as err:
            client.submit(outside, "Describe the image.")
        assert err.value.code == "bad_image_source" and "not in this pool's storage" in str(err.value)


def test_a_uri_in_the_pools_storage_is_read_through_storage_with_the_byte_cap(client: Client) -> None:
    client.storage.put("uploads/cat.png", png(64, 64))
    job = client.submit(f"{client.storage.url}/uploads/cat.png", "Describe the image.")
    assert client.storage.get(job.info()["input_key"]) == png(64, 64)
    client.storage.put("uploads/big.png", png(64, 64) + bytes(client.settings.max_image_bytes))
    with pytest.raises(InvalidRequest) as err:
        client.submit(f"{client.storage.url}/uploads/big.png", "Describe the image.")
    assert err.value.code == "image_too_large"


def test_idempotency_key_returns_the_first_job(client: Client) -> None:
    first = client.submit(png(), "Describe the image.", idempotency_key="k1")
    again = client.submit(png(200, 200), "Other question?", idempotency_key="k1")
    other = client.submit(png(), "Describe the image.", idempotency_key="k2")
    assert again.id == first.id != other.id
    assert len(_queued_messages(client, "vlmq.tiny-shapes.xs")) == 2


def test_cancel_a_queued_job(client: Client) -> None:
    job = client.submit(png(), "Describe the image.")
    assert job.cancel() is True
    assert job.status() is JobStatus.CANCELED
    assert client.redis.exists(keys.canceled(job.id))
    with pytest.raises(JobFailed) as err:
        job.result(timeout=1)
    assert err.value.error_type == "canceled"


def test_unknown_job_and_result_timeout(client: Client) -> None:
    with pytest.raises(JobNotFound):
        client.job("nope")
    job = client.submit(png(), "Describe the image.")
    start = time.monotonic()
    with pytest.raises(JobTimeout):
        job.result(timeout=0.3)
    assert time.monotonic() - start < 2


def test_submit_many_validates_everything_before_enqueueing(client: Client) -> None:
    with pytest.raises(InvalidRequest) as err:
        client.submit_many([{"image": png(), "prompt": "Describe the image."},
                            {"image": b"", "prompt": "Describe the image."}])
    assert "request 1" in str(err.value) and err.value.code == "empty_image"
    assert client.redis.keys(keys.job("*")) == []
    jobs = client.submit_many([{"image": png(), "prompt": "Describe the image.", "priority": 1}] * 3)
    assert len({j.id for j in jobs}) == 3


def test_redis_down_raises_backend_error_quickly(tmp_path: Path) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    with Client(settings=Settings(broker_url=dead, storage_url=f"file://{tmp_path}")) as client:
        start = time.monotonic()
        with pytest.raises(BackendError):
            client.submit(png(), "Describe the image.")
        assert time.monotonic() - start < 10


def test_full_queue_raises_queue_full_or_waits_for_room(redis_client: object, redis_url: str, tmp_path: Path) -> None:
    settings = Settings(broker_url=redis_url, storage_url=f"file://{tmp_path}", max_queue_depth="xs=3,s=0")
    with Client(settings=settings) as client:
        for _ in range(3):
            client.submit(png(), "Describe the image.")
        with pytest.raises(QueueFull, match="limit is 3"):
            client.submit(png(), "Describe the image.")
        start = time.monotonic()
        with pytest.raises(QueueFull):
            client.submit(png(), "Describe the image.", wait_for_room=0.5)
        assert 0.5 <= time.monotonic() - start < 3
        client.submit(png(1000, 1000), "Describe the image.")  # class s has no limit
        # a consumer takes one message: a waiting submit gets in
        threading.Timer(0.3, lambda: client.redis.rpop("vlmq.tiny-shapes.xs:5")).start()
        assert client.submit(png(), "Describe the image.", wait_for_room=5).status() is JobStatus.QUEUED
        assert client.queue_depth("tiny-shapes", "xs") == 3
        assert len(client.redis.keys(keys.job("*"))) == 5
