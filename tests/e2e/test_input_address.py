"""Inputs prove what they are: bytes stored under another image's content address never answer for it.

Anyone who can write the bucket (an untenanted producer, every process on a ``file://`` store) can put image Y's
bytes at ``inputs/<sha256(X)>``. The SDK replaces such an object when it submits X (the store must vouch for the
bytes: S3's SHA-256 checksum), and a worker checks ``sha256(bytes)`` of every input it reads, failing a job whose
input was overwritten after its upload with ``input_corrupt`` and serving the others.
"""
from __future__ import annotations

import hashlib
import io

import pytest
from inputs import scene_png
from PIL import Image
from workerproc import TINY_CLASSES, WorkerProcess

from vlmq import keys
from vlmq.client import Client
from vlmq.errors import JobFailed
from vlmq.settings import Settings
from vlmq.workers.engine.engine import Engine, Request
from vlmq.workers.main import ASSETS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
QUESTION = "How many shapes are there?"


def cold_answers(images: list[bytes]) -> list[list[int]]:
    engine = Engine.from_model_dir(ASSETS / "tiny-shapes", num_blocks=256)
    requests = [Request(Image.open(io.BytesIO(image)).convert("RGB"), QUESTION, 16) for image in images]
    return [out.token_ids for out in engine.generate(requests)]


def test_an_image_stored_under_another_images_address_never_answers_for_it(redis_url, s3_server, s3_storage_url,
                                                                          tmp_path) -> None:
    import redis

    redis.Redis.from_url(redis_url).flushdb()
    settings = Settings(broker_url=redis_url, storage_url=s3_storage_url, s3_endpoint_url=s3_server.url,
                        cost_classes=TINY_CLASSES)
    x, y, z = scene_png(1), scene_png(2), scene_png(3)
    answer_x, answer_y = cold_answers([x, y])
    assert answer_x != answer_y  # the scenes are told apart by their answers
    with Client(settings=settings) as client:
        address_x = keys.input_object(hashlib.sha256(x).hexdigest())
        client.storage.put(address_x, y)  # the poison, before an honest producer submits X
        honest = client.submit(x, QUESTION, max_new_tokens=16)
        late = client.submit(z, QUESTION, max_new_tokens=16)
        client.storage.put(keys.input_object(hashlib.sha256(z).hexdigest()), y)  # overwritten after its upload
        other = client.submit(y, QUESTION, max_new_tokens=16)
        worker = WorkerProcess(settings, tmp_path / "worker.log")  # starts after all three are queued
        try:
            worker.wait_ready()
            assert honest.result(timeout=300).token_ids == answer_x  # X's answer, not Y's
            with pytest.raises(JobFailed) as failure:
                late.result(timeout=300)
            assert failure.value.error_type == "input_corrupt" and not failure.value.retryable, failure.value
            assert "submit the image again" in failure.value.message
            assert other.result(timeout=300).token_ids == answer_y  # the corrupt input failed its job alone
            assert worker.alive()
        finally:
            worker.stop()
        assert client.storage.get(address_x) == x  # the SDK replaced the object that was not X
