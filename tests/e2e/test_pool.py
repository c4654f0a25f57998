"""The whole pool end to end: SDK -> Redis queues -> a real worker process -> S3 results."""
from __future__ import annotations

import io
from collections import Counter
from collections.abc import Iterator

import pytest
from workerproc import TINY_CLASSES, WorkerProcess

from vlmq.client import Client
from vlmq.errors import InvalidRequest
from vlmq.jobs import JobStatus
from vlmq.settings import Settings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

# (width, height) -> expected cost class for tiny-shapes under TINY_CLASSES (20, 24, 77, 154, 324, 288 tokens)
SIZES = {(96, 80): "xs", (320, 240): "xs", (600, 400): "s", (800, 640): "s", (1000, 1000): "m", (1024, 900): "m"}


def png(width: int, height: int, seed: int) -> bytes:
    """A shapes scene the bundled model was trained on (held-out seed)."""
    from tiny.shapes import make_example

    buf = io.BytesIO()
    make_example((4242, seed), size=(width, height)).image.save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def pool(redis_url: str, s3_server,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Settings, WorkerProcess]]:
    import redis

    redis.Redis.from_url(redis_url).flushdb()
    settings = Settings(broker_url=redis_url, storage_url="s3://vlmq-test/e2e-pool", s3_endpoint_url=s3_server.url,
                        cost_classes=TINY_CLASSES)
    worker = WorkerProcess(settings, tmp_path_factory.mktemp("pool") / "worker.log", "--name", "e2e-worker")
    try:
        worker.wait_ready()
        yield settings, worker
    finally:
        worker.stop()


def test_fifty_jobs_of_three_classes_all_finish_with_full_results(pool: tuple[Settings, WorkerProcess]) -> None:
    settings, worker = pool
    sizes = list(SIZES)
    with Client(settings=settings) as client:
        jobs = [client.submit(png(*sizes[i % len(sizes)], seed=i), "Describe the image.", max_new_tokens=24)
                for i in range(54)]
        classes = Counter(job.info()["cost_class"] for job in jobs)
        assert set(classes) == {"xs", "s", "m"}, classes
        for i, job in enumerate(jobs):
            assert job.info()["cost_class"] == SIZES[sizes[i % len(sizes)]]
        results = [job.result(timeout=600) for job in jobs]
        for job, result in zip(jobs, results, strict=True):
            assert job.status() is JobStatus.FINISHED
            info = job.info()
            assert float(info["queued_at"]) <= float(info["started_at"]) <= float(info["finished_at"])
            assert result.job_id == job.id and result.model == "tiny-shapes"
            assert result.worker == "e2e-worker"
            assert isinstance(result.text, str)
            assert result.usage["generated_tokens"] == len(result.token_ids) <= 24
            assert result.usage["image_tokens"] == int(info["vision_tokens"])
            assert result.usage["prompt_tokens"] > result.usage["image_tokens"]
            assert result.finish_reason in ("stop", "length")
            assert {"queue", "fetch", "decode_image", "model", "total"} <= set(result.timings)
        # the results really are in the S3-compatible server, one object per job
        listed = client.storage.client.list_objects_v2(Bucket="vlmq-test", Prefix="e2e-pool/results/")
        keys = {o["Key"] for o in listed["Contents"]}
        assert keys == {f"e2e-pool/results/{job.id}.json" for job in jobs}
    assert worker.alive()


def test_same_idempotency_key_returns_the_same_job(pool: tuple[Settings, WorkerProcess]) -> None:
    settings, _ = pool
    with Client(settings=settings) as client:
        first = client.submit(png(64, 64, 1), "How many circles?", idempotency_key="order-17")
        second = client.submit(png(64, 64, 1), "How many circles?", idempotency_key="order-17")
        assert second.id == first.id
        with pytest.raises(InvalidRequest) as err:  # the key is bound to the first request's content
            client.submit(png(64, 64, 2), "How many circles?", idempotency_key="order-17")
        assert err.value.code == "idempotency_conflict"
        assert client.job(first.id).result(timeout=300).job_id == first.id


def reference_answers(samples: list[tuple[bytes, str, str, str]], max_new_tokens: int) -> list[str]:
    """Greedy answers of the bundled model through plain transformers, one request at a time."""
    import torch
    from transformers import AutoModelForImageTextToText

    from vlmq.images import decode
    from vlmq.workers.main import ASSETS
    from vlmq.workers.models.processor import load_processor, render_prompt

    model = AutoModelForImageTextToText.from_pretrained(ASSETS / "tiny-shapes", local_files_only=True).eval()
    processor = load_processor(ASSETS / "tiny-shapes")
    answers = []
    for data, _, prompt, _ in samples:
        inputs = processor(text=[render_prompt(processor, prompt)], images=[decode(data)], return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        ids = out[0, inputs["input_ids"].shape[1]:]
        answers.append(processor.tokenizer.decode(ids, skip_special_tokens=True))
    return answers


def test_pool_answers_equal_the_models_own_greedy_answers(pool: tuple[Settings, WorkerProcess]) -> None:
    """Batching across jobs of different sizes must not change any answer (padding, positions, images)."""
    from vlmq.demo import load_samples

    settings, worker = pool
    assert "with the engine backend" in worker.log(), "the engine is the default backend"
    samples = load_samples()
    with Client(settings=settings) as client:
        jobs = [client.submit(data, prompt, max_new_tokens=40) for data, _, prompt, _ in samples]
        long = client.submit(samples[0][0], samples[0][2], max_new_tokens=50, ignore_eos=True)
        answers = [job.result(timeout=300).text for job in jobs]
        assert len(long.result(timeout=300).token_ids) == 50
    assert answers == reference_answers(samples, 40)
