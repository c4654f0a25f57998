"""Another worker, warm: KV one worker computed is reused by another through the pool's S3 archive.

Worker A serves image X and stops; worker B (a new process, nothing in memory) answers a new question on X
with X's encoder output from A's archive (an archive hit in B's counters) and gives the answer a cold run gives.
"""
from __future__ import annotations

import io
import re
import struct
import time

import msgpack
import pytest
from inputs import scene_png
from PIL import Image
from workerproc import TINY_CLASSES, WorkerProcess

from vlmq import keys
from vlmq.client import Client
from vlmq.settings import Settings
from vlmq.storage import open_storage
from vlmq.workers.engine.engine import Engine, Request
from vlmq.workers.kvstore.format import MAGIC
from vlmq.workers.main import ASSETS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
QUESTION_B = "What color is the largest shape?"
ARCHIVE_KEY = "e2e-kv-archive-key-shared-by-workers"  # VLMQ_KV_ARCHIVE_KEY: workers hold it, producers do not


def tier_counts(worker: WorkerProcess) -> dict[str, int]:
    lines = [line for line in worker.log().splitlines() if "kv tiers:" in line]
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", lines[-1])} if lines else {}


def archived_objects(settings: Settings) -> list[str]:
    storage = open_storage(settings.storage_url, settings.s3_endpoint_url)
    return [o.key for o in storage.list_objects(keys.KV_ROOT)]


def serve(settings: Settings, log_path, image: bytes, question: str,
          wait_archived: bool = False) -> tuple[list[int], dict[str, int]]:
    worker = WorkerProcess(settings, log_path, "--name", log_path.stem)
    try:
        worker.wait_ready()
        with Client(settings=settings) as client:
            result = client.submit(image, question, max_new_tokens=16).result(timeout=300)
        counts = tier_counts(worker)
        deadline = time.monotonic() + 30
        while wait_archived and not archived_objects(settings) and time.monotonic() < deadline:
            time.sleep(0.1)  # the upload runs on the worker's store thread, after the job's result
    finally:
        worker.stop()
    return result.token_ids, counts


def test_a_second_worker_answers_from_the_first_workers_archive(redis_url, s3_server, s3_storage_url,
                                                                tmp_path) -> None:
    import redis

    redis.Redis.from_url(redis_url).flushdb()
    settings = Settings(broker_url=redis_url, storage_url=s3_storage_url, s3_endpoint_url=s3_server.url,
                        cost_classes=TINY_CLASSES, worker_batch=2, kv_archive_key=ARCHIVE_KEY)
    image = scene_png(1)
    _, a = serve(settings, tmp_path / "worker-a.log", image, "How many shapes are there?", wait_archived=True)
    assert a["encoded_images"] == 1  # A computed X ...
    archived = archived_objects(settings)
    assert any("/enc/" in key for key in archived)  # ... and archived its encoder output
    model_hash = archived[0].removeprefix(keys.KV_ROOT).split("/", 1)[0]  # A's heartbeat named the prefix
    assert redis.Redis.from_url(redis_url).hget(keys.kv_models(), model_hash) == b"tiny-shapes"
    warm, b = serve(settings, tmp_path / "worker-b.log", image, QUESTION_B)
    assert b["archive_hits"] >= 1 and b["tier_restored_images"] == 1 and b["encoded_images"] == 0
    cold = Engine.from_model_dir(ASSETS / "tiny-shapes", num_blocks=256)  # no store: computes everything
    out = cold.generate([Request(Image.open(io.BytesIO(image)).convert("RGB"), QUESTION_B, 16)])[0]
    assert cold.stats.num_encoded_images == 1 and warm == out.token_ids


def cold_answer(image: bytes, question: str) -> list[int]:
    cold = Engine.from_model_dir(ASSETS / "tiny-shapes", num_blocks=256)  # no store: computes everything
    return cold.generate([Request(Image.open(io.BytesIO(image)).convert("RGB"), question, 16)])[0].token_ids


def wait_for(done, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def rekeyed(blob: bytes, key: str) -> bytes:
    """An archive object with only its header's key changed; everything after the header kept as it is."""
    (n,) = struct.unpack_from("<I", blob, len(MAGIC))
    header = msgpack.unpackb(blob[len(MAGIC) + 4:len(MAGIC) + 4 + n])
    raw = msgpack.packb({**header, "key": key})
    return MAGIC + struct.pack("<I", len(raw)) + raw + blob[len(MAGIC) + 4 + n:]


def test_a_poisoned_archive_object_never_answers_for_another_image(redis_url, s3_server, s3_storage_url,
                                                                   tmp_path) -> None:
    # Issue 36 item 3: anyone who can write kv/ took Y's encoder object, put X's key in its header (its payload
    # checksum still valid) and stored it under X's name; a fresh worker then answered about X with Y's caption.
    import redis

    redis.Redis.from_url(redis_url).flushdb()
    settings = Settings(broker_url=redis_url, storage_url=s3_storage_url, s3_endpoint_url=s3_server.url,
                        cost_classes=TINY_CLASSES, worker_batch=2, kv_archive_key=ARCHIVE_KEY)
    storage = open_storage(settings.storage_url, settings.s3_endpoint_url)
    x, y = scene_png(1), scene_png(2)
    answer_x, answer_y = cold_answer(x, QUESTION_B), cold_answer(y, QUESTION_B)
    assert answer_x != answer_y  # the scenes are told apart by their answers

    def encoder_objects() -> list[str]:
        return [key for key in archived_objects(settings) if "/enc/" in key]

    worker = WorkerProcess(settings, tmp_path / "worker-a.log", "--name", "worker-a")
    try:  # worker A archives Y's encoder output, then X's
        worker.wait_ready()
        with Client(settings=settings) as client:
            client.submit(y, "How many shapes are there?", max_new_tokens=16).result(timeout=300)
            wait_for(lambda: len(encoder_objects()) == 1, "Y's encoder output was not archived")
            [y_name] = encoder_objects()
            client.submit(x, "How many shapes are there?", max_new_tokens=16).result(timeout=300)
            wait_for(lambda: len(encoder_objects()) == 2, "X's encoder output was not archived")
    finally:
        worker.stop()
    [x_name] = [name for name in encoder_objects() if name != y_name]
    forged = rekeyed(storage.get(y_name), x_name.rsplit("/", 1)[1])
    storage.put(x_name, forged)  # the poison: Y's tensors, X's key, under X's name
    warm, b = serve(settings, tmp_path / "worker-b.log", x, QUESTION_B)
    assert warm == answer_x and warm != answer_y  # X's answer, computed afresh
    assert b["encoded_images"] == 1 and b["archive_bad_objects"] >= 1 and b["tier_restored_images"] == 0, b
    wait_for(lambda: storage.exists(x_name) and storage.get(x_name) != forged,
             "the refused object was not replaced by X's own")  # deleted, then archived again from X itself
