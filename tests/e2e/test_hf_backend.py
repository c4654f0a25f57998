"""``vlmq worker --backend hf`` keeps the transformers path and serves the pool with transformers' greedy answers.

The default backend (the engine) is what every other e2e test runs; test_backends.py holds both to one contract.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from test_pool import reference_answers
from workerproc import WorkerProcess

from vlmq.client import Client
from vlmq.demo import load_samples
from vlmq.settings import Settings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def test_hf_backend_answers_equal_transformers(redis_url: str, s3_server, s3_storage_url: str,
                                               tmp_path: Path) -> None:
    import redis

    redis.Redis.from_url(redis_url).flushdb()
    settings = Settings(broker_url=redis_url, storage_url=s3_storage_url, s3_endpoint_url=s3_server.url)
    worker = WorkerProcess(settings, tmp_path / "worker.log", "--name", "hf-worker", "--backend", "hf")
    try:
        worker.wait_ready()
        assert "serving tiny-shapes on cpu with the hf backend" in worker.log()
        samples = load_samples()
        with Client(settings=settings) as client:
            jobs = [client.submit(data, prompt, max_new_tokens=40) for data, _, prompt, _ in samples]
            long = client.submit(samples[0][0], samples[0][2], max_new_tokens=50, ignore_eos=True)
            results = [job.result(timeout=600) for job in jobs]
            assert len(long.result(timeout=600).token_ids) == 50
        assert [r.text for r in results] == reference_answers(samples, 40)
        assert all(r.worker == "hf-worker" for r in results)
        assert worker.alive()
    finally:
        worker.stop()
