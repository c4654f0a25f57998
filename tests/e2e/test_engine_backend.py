"""The worker on the vlmq engine (``--backend engine``) serves the pool with transformers' greedy answers."""
from __future__ import annotations

from pathlib import Path

import pytest
from test_pool import reference_answers
from workerproc import WorkerProcess

from vlmq.client import Client
from vlmq.demo import load_samples
from vlmq.settings import Settings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def test_engine_backend_answers_equal_transformers(redis_url: str, s3_server, s3_storage_url: str,
                                                   tmp_path: Path) -> None:
    import redis

    redis.Redis.from_url(redis_url).flushdb()
    settings = Settings(broker_url=redis_url, storage_url=s3_storage_url, s3_endpoint_url=s3_server.url,
                        backend="engine")
    worker = WorkerProcess(settings, tmp_path / "worker.log", "--name", "engine-worker")
    try:
        worker.wait_ready()
        samples = load_samples()
        with Client(settings=settings) as client:
            jobs = [client.submit(data, prompt, max_new_tokens=40) for data, _, prompt, _ in samples]
            long = client.submit(samples[0][0], samples[0][2], max_new_tokens=50, ignore_eos=True)
            results = [job.result(timeout=600) for job in jobs]
            assert len(long.result(timeout=600).token_ids) == 50
        assert [r.text for r in results] == reference_answers(samples, 40)
        assert all(r.worker == "engine-worker" for r in results)
        assert worker.alive()
    finally:
        worker.stop()
