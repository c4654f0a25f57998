"""Load: 5,000 jobs from several producer processes, drained by CPU workers, nothing lost."""
from __future__ import annotations

import io
import multiprocessing as mp
from pathlib import Path

import pytest
from PIL import Image
from workerproc import WorkerProcess

from vlmq import keys
from vlmq.client import Client
from vlmq.jobs import JobStatus
from vlmq.settings import Settings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
NUM_PRODUCERS, JOBS_PER_PRODUCER = 4, 1250


def tiny_png(i: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (56 + i % 8, 56), (i % 256, (i // 256) % 256, 7)).save(buf, "PNG")
    return buf.getvalue()


def produce(settings: Settings, producer: int, out: mp.Queue) -> None:
    with Client(settings=settings) as client:
        requests = [{"image": tiny_png(producer * JOBS_PER_PRODUCER + i), "prompt": "How many shapes?",
                     "max_new_tokens": 1} for i in range(JOBS_PER_PRODUCER)]
        half = JOBS_PER_PRODUCER // 2
        ids = [client.submit(r.pop("image"), r.pop("prompt"), **r).id for r in requests[:half]]
        ids += [j.id for j in client.submit_many(requests[half:])]
    out.put(ids)


def test_five_thousand_jobs_from_four_producers_all_finish(redis_url: str, tmp_path: Path) -> None:
    import redis

    redis.Redis.from_url(redis_url).flushdb()
    settings = Settings(broker_url=redis_url, storage_url=f"file://{tmp_path / 'store'}", worker_batch=32,
                        worker_budget=32 * 2304)
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    producers = [ctx.Process(target=produce, args=(settings, p, out)) for p in range(NUM_PRODUCERS)]
    for p in producers:
        p.start()
    workers = [WorkerProcess(settings, tmp_path / f"w{i}.log", "--name", f"w{i}") for i in range(2)]
    try:
        ids = [i for _ in producers for i in out.get(timeout=600)]
        for p in producers:
            p.join(60)
            assert p.exitcode == 0
        assert len(set(ids)) == NUM_PRODUCERS * JOBS_PER_PRODUCER
        with Client(settings=settings) as client:
            for job_id in ids:
                client.job(job_id).result(timeout=900)
            statuses = {client.job(i).status() for i in ids}
            assert statuses == {JobStatus.FINISHED}
            results = list((tmp_path / "store" / "results").iterdir())
            assert len(results) == len(ids)
            assert client.queue_depth("tiny-shapes", "xs") == 0
            assert client.redis.hlen("unacked") == 0
            assert all(client.storage.exists(keys.result_object(i)) for i in ids)
    finally:
        for w in workers:
            w.stop()
