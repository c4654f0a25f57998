"""A Qwen3-VL checkpoint folder served by the pool (VLMQ_MODELS=name=/folder) on both backends: SDK -> Redis ->
a real `vlmq worker --model ... --backend engine|hf` process -> S3 results, greedy tokens equal to transformers'
one request at a time."""
from __future__ import annotations

import io
import random
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from tiny.qwen3_vl import build
from workerproc import WorkerProcess

from vlmq.client import Client
from vlmq.settings import Settings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
MODEL, MAX_NEW = "tiny-qwen3-vl", 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("qwen3") / MODEL)


@pytest.fixture(scope="module")
def jobs() -> list[tuple[bytes, str]]:
    rnd, out = random.Random(5), []
    for i in range(8):
        pixels = np.random.default_rng(i).integers(0, 256, (rnd.randint(24, 300), rnd.randint(24, 300), 3))
        buf = io.BytesIO()
        Image.fromarray(pixels.astype(np.uint8)).save(buf, "PNG")
        out.append((buf.getvalue(), f"what is at the {rnd.choice(['left', 'right', 'top'])} of image {i}?"))
    return out


@pytest.fixture(scope="module")
def reference(model_dir, jobs) -> list[list[int]]:
    import torch
    from transformers import AutoModelForImageTextToText

    from vlmq.images import decode
    from vlmq.workers.models.processor import load_processor, render_prompt

    model = AutoModelForImageTextToText.from_pretrained(model_dir, local_files_only=True).eval()
    processor = load_processor(model_dir)
    eos, out = model.generation_config.eos_token_id, []
    for data, prompt in jobs:
        inputs = processor(text=[render_prompt(processor, prompt)], images=[decode(data)], return_tensors="pt")
        with torch.inference_mode():
            ids = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)[0, inputs["input_ids"].shape[1]:]
        out.append([t for t in ids.tolist() if t != eos])
    return out


def test_pool_serves_qwen3_vl_on_both_backends(redis_url, s3_server, s3_storage_url, model_dir, jobs, reference,
                                                 tmp_path):
    """One worker per backend, started together, each serving the folder under its own model name."""
    import redis

    redis.Redis.from_url(redis_url).flushdb()
    names = {backend: f"{MODEL}-{backend}" for backend in ("engine", "hf")}
    settings = Settings(broker_url=redis_url, storage_url=s3_storage_url, s3_endpoint_url=s3_server.url,
                        models={name: str(model_dir) for name in names.values()})
    workers = {backend: WorkerProcess(settings, tmp_path / f"{backend}.log", "--model", name, "--name", name,
                                      "--backend", backend) for backend, name in names.items()}
    try:
        for backend, worker in workers.items():
            worker.wait_ready()
            assert f"serving {names[backend]} on cpu with the {backend} backend" in worker.log()
        with Client(settings=settings) as client:
            handles = {name: [client.submit(data, prompt, model=name, max_new_tokens=MAX_NEW) for data, prompt in jobs]
                       for name in names.values()}
            for name, submitted in handles.items():
                results = [job.result(timeout=300) for job in submitted]
                assert [r.token_ids for r in results] == reference, name
                for job, result in zip(submitted, results, strict=True):
                    assert result.model == result.worker == name
                    assert result.usage["image_tokens"] == int(job.info()["vision_tokens"]) > 0
        assert all(worker.alive() for worker in workers.values())
    finally:
        for worker in workers.values():
            worker.stop()
