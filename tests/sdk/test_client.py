"""The SDK against a real Redis-compatible server and file storage (no worker running)."""
from __future__ import annotations

import io
import json
import threading
import time
from pathlib import Path

import pytest
from PIL import Image

from vlmq import keys, store
from vlmq.client import Client
from vlmq.embedded import free_port
from vlmq.errors import BackendError, InvalidRequest, JobFailed, JobNotFound, JobTimeout, QueueFull
from vlmq.jobs import Job, JobStatus
from vlmq.request import JobRequest
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
            client.submit(Image.new("RGB", (60, 40)), "Describe the image."),
            client.submit(f"file://{path}", "Describe the image.")]  # a file:// URL is a local path
    assert all(j.status() is JobStatus.QUEUED for j in jobs)
    assert jobs[3].info()["input_key"] == jobs[0].info()["input_key"]
    with pytest.raises(InvalidRequest) as err:
        client.submit("s3://elsewhere/img.png", "Describe the image.")
    assert err.value.code == "fetch_refused" and "VLMQ_IMAGE_FETCH_ALLOW" in str(err.value)  # vlmq.remote


def test_a_uri_in_the_pools_storage_is_read_through_storage_with_the_byte_cap(client: Client) -> None:
    client.storage.put("uploads/cat.png", png(64, 64))
    job = client.submit(f"{client.storage.url}/uploads/cat.png", "Describe the image.")
    assert client.storage.get(job.info()["input_key"]) == png(64, 64)
    client.storage.put("uploads/big.png", png(64, 64) + bytes(client.settings.max_image_bytes))
    with pytest.raises(InvalidRequest) as err:
        client.submit(f"{client.storage.url}/uploads/big.png", "Describe the image.")
    assert err.value.code == "image_too_large"


def test_an_idempotency_key_returns_the_first_job_for_the_same_request_only(client: Client) -> None:
    first = client.submit(png(), "Describe the image.", idempotency_key="k1")
    assert client.submit(png(), "Describe the image.", idempotency_key="k1").id == first.id
    [again] = client.submit_many([JobRequest(png(), "Describe the image.", idempotency_key="k1")])
    assert again.id == first.id
    other = client.submit(png(), "Describe the image.", idempotency_key="k2")
    assert other.id != first.id
    changes = [dict(image=png(200, 200)), dict(prompt="Other question?"), dict(max_new_tokens=7),
               dict(priority=1), dict(ignore_eos=True)]
    for change in changes:
        request = {"image": png(), "prompt": "Describe the image.", "idempotency_key": "k1", **change}
        with pytest.raises(InvalidRequest) as err:
            client.submit(request.pop("image"), request.pop("prompt"), **request)
        assert err.value.code == "idempotency_conflict" and first.id in str(err.value), change
    assert len(_queued_messages(client, "vlmq.tiny-shapes.xs")) == 2


def test_an_idempotency_conflict_in_a_batch_enqueues_nothing_and_frees_its_keys(client: Client) -> None:
    first = client.submit(png(), "Describe the image.", idempotency_key="k1")
    batch = [{"image": png(), "prompt": "How many shapes?", "idempotency_key": "new"},
             {"image": png(), "prompt": "Another question?", "idempotency_key": "k1"}]
    with pytest.raises(InvalidRequest) as err:
        client.submit_many(batch)
    assert err.value.code == "idempotency_conflict"
    assert not client.redis.exists(keys.idempotency("new")) and len(client.redis.keys(keys.job("*"))) == 1
    batch[1]["prompt"] = "Describe the image."
    jobs = client.submit_many(batch + [batch[0]])  # the same key twice in a batch is one job
    assert jobs[1].id == first.id and jobs[0].id == jobs[2].id != first.id
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
    with pytest.raises(JobNotFound, match="no job 'nope'"):
        client.job("nope")
    job = client.submit(png(), "Describe the image.")
    start = time.monotonic()
    with pytest.raises(JobTimeout, match=f"job {job.id} still queued after 0.3 s"):
        job.result(timeout=0.3)
    assert time.monotonic() - start >= 0.3  # it waited as long as asked
    assert job.status() is JobStatus.QUEUED  # a timeout leaves the job alone: it may still finish


def test_submit_many_validates_everything_before_enqueueing(client: Client) -> None:
    with pytest.raises(InvalidRequest) as err:
        client.submit_many([{"image": png(), "prompt": "Describe the image."},
                            {"image": b"", "prompt": "Describe the image."}])
    assert "request 1" in str(err.value) and err.value.code == "empty_image"
    assert client.redis.keys(keys.job("*")) == []
    jobs = client.submit_many([{"image": png(), "prompt": "Describe the image.", "priority": 1}] * 3)
    assert len({j.id for j in jobs}) == 3


def test_redis_down_raises_a_backend_error_naming_the_broker(tmp_path: Path) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    with Client(settings=Settings(broker_url=dead, storage_url=f"file://{tmp_path}")) as client:
        with pytest.raises(BackendError, match=f"Redis at {dead} failed"):
            client.submit(png(), "Describe the image.")
        with pytest.raises(BackendError, match=f"Redis at {dead} failed"):
            Job(client.store, "any").status()


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
        assert time.monotonic() - start >= 0.5  # it waited for room as long as asked
        assert client.queue_depth("tiny-shapes", "xs") == 3
        client.submit(png(1000, 1000), "Describe the image.")  # class s has no limit
        # a consumer takes one message: a waiting submit gets in
        threading.Timer(0.3, lambda: client.redis.rpop("vlmq.tiny-shapes.xs:5")).start()
        assert client.submit(png(), "Describe the image.", wait_for_room=5).status() is JobStatus.QUEUED
        assert client.queue_depth("tiny-shapes", "xs") == 3
        assert len(client.redis.keys(keys.job("*"))) == 5


def _wait_until_a_client_blocks(client: Client, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not any("b" in c["flags"] for c in client.redis.client_list()):
        assert time.monotonic() < deadline, "result() never blocked on the done list"
        time.sleep(0.01)


def test_a_job_that_was_waited_on_leaves_its_done_list_with_a_ttl(client: Client) -> None:
    job = client.submit(png(), "Describe the image.")

    def finish_like_a_worker() -> None:
        _wait_until_a_client_blocks(client)
        doc = {"job_id": job.id, "model": "tiny-shapes", "text": "ok", "token_ids": [1], "finish_reason": "stop",
               "usage": {}, "timings": {}, "worker": "test"}
        client.storage.put(keys.result_object(job.id), json.dumps(doc).encode())
        store.transition(client.redis, job.id, [JobStatus.QUEUED], JobStatus.FINISHED, ttl=60)

    worker = threading.Thread(target=finish_like_a_worker)
    worker.start()
    assert job.result(timeout=20).text == "ok"
    worker.join()
    assert client.redis.lrange(keys.done(job.id), 0, -1) == [b"finished"]
    assert 0 < client.redis.ttl(keys.done(job.id)) <= store.DONE_TTL
    assert job.result(timeout=1).text == "ok"  # a second waiter still finds it


def test_records_of_jobs_that_never_end_expire(redis_client: object, redis_url: str, tmp_path: Path) -> None:
    settings = Settings(broker_url=redis_url, storage_url=f"file://{tmp_path}", job_ttl=100)
    with Client(settings=settings) as client:
        job = client.submit(png(), "Describe the image.")
        assert 90 < client.redis.ttl(keys.job(job.id)) <= 100
        assert client.redis.ttl(keys.done(job.id)) == -2  # no done list before the job ends
        store.transition(client.redis, job.id, [JobStatus.QUEUED], JobStatus.STARTED)  # what a worker does
        client.redis.expire(keys.job(job.id), 50)
        assert 40 < client.redis.ttl(keys.job(job.id)) <= 50  # a start keeps the record's TTL
        assert job.cancel() is True
        assert 90 < client.redis.ttl(keys.job(job.id)) <= 100  # the end sets it again
        assert 90 < client.redis.ttl(keys.canceled(job.id)) <= 100
        assert all(client.redis.ttl(k) > 0 for k in client.redis.keys("vlmq:*"))


def test_canceling_an_unknown_job_stores_nothing(client: Client) -> None:
    before = client.redis.dbsize()
    for job_id in ("nope", "x" * 100_000):
        with pytest.raises(JobNotFound):
            Job(client.store, job_id).cancel()
    assert client.redis.dbsize() == before == 0


def test_submit_many_checks_the_queue_limit_against_the_whole_batch(redis_client: object, redis_url: str,
                                                                     tmp_path: Path) -> None:
    settings = Settings(broker_url=redis_url, storage_url=f"file://{tmp_path / 'store'}", max_queue_depth="5")
    request = {"image": png(), "prompt": "Describe the image."}
    with Client(settings=settings) as client:
        with pytest.raises(QueueFull, match="adds 10000 jobs to queue vlmq.tiny-shapes.xs, its limit is 5"):
            client.submit_many([request] * 10_000, wait_for_room=60)
        assert client.queue_depth("tiny-shapes", "xs") == 0 and client.redis.dbsize() == 0
        assert not (tmp_path / "store" / "inputs").exists()
        assert len(client.submit_many([request] * 3)) == 3
        with pytest.raises(QueueFull, match="holds 3 jobs, its limit is 5"):
            client.submit_many([request] * 3)
        assert client.queue_depth("tiny-shapes", "xs") == 3 and len(client.redis.keys(keys.job("*"))) == 3
        assert len(client.submit_many([JobRequest(png(), "How many shapes?")] * 2)) == 2
        assert client.queue_depth("tiny-shapes", "xs") == 5


def test_submit_many_names_the_request_with_an_unknown_field(client: Client) -> None:
    with pytest.raises(InvalidRequest) as err:
        client.submit_many([{"image": png(), "prompt": "Describe the image."},
                            {"image": png(), "prompt": "Describe the image.", "max_tokens": 5}])
    assert err.value.code == "unknown_field" and str(err.value).startswith("request 1: unknown field(s) max_tokens")
    assert client.redis.dbsize() == 0
