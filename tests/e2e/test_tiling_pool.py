"""An InternVL or LLaVA-NeXT checkpoint folder served by the pool end to end (`VLMQ_MODELS=name=/folder`): SDK ->
Redis queue -> a real worker process on either backend -> S3 results, with transformers' greedy answers."""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from tiny.internvl import build_internvl
from tiny.llava_next import build_llava_next
from workerproc import WorkerProcess

from vlmq.client import Client
from vlmq.settings import Settings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
SIZES = [(60, 130), (300, 200), (40, 40), (250, 90)]  # InternVL: 3, 7, 1 and 4 tiles; LLaVA-NeXT: 4, 5, 3, 4
BUILDERS = {"internvl": build_internvl, "llava_next": build_llava_next}
MAX_NEW = 12


@pytest.fixture(scope="module", params=list(BUILDERS))
def model(request, tmp_path_factory) -> tuple[str, Path, list[bytes], list[list[int]]]:
    """The tiny checkpoint, PNG inputs, and transformers' greedy completions of them (eos stripped)."""
    import torch
    from transformers import AutoModelForImageTextToText

    from vlmq.workers.models.processor import load_processor, render_prompt

    family = request.param
    path = BUILDERS[family](tmp_path_factory.mktemp(family) / f"tiny-{family}")
    ref = AutoModelForImageTextToText.from_pretrained(path).eval()
    processor = load_processor(path)
    images, answers = [], []
    for i, (w, h) in enumerate(SIZES):
        image = Image.fromarray(np.random.default_rng(i).integers(0, 256, (h, w, 3), dtype=np.uint8))
        buf = io.BytesIO()
        image.save(buf, "PNG")
        images.append(buf.getvalue())
        inputs = processor(text=[render_prompt(processor, f"what is in {i}?")], images=[image], return_tensors="pt")
        with torch.inference_mode():
            out = ref.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)[0, inputs["input_ids"].shape[1]:]
        answers.append([t for t in out.tolist() if t != ref.generation_config.eos_token_id])
    return family, path, images, answers


@pytest.mark.parametrize("backend", ["engine", "hf"])
def test_pool_serves_tiling_family_with_transformers_answers(redis_url: str, s3_server, model, backend: str,
                                                        tmp_path: Path) -> None:
    import redis

    redis.Redis.from_url(redis_url).flushdb()
    family, path, images, answers = model
    name = f"tiny-{family}"
    settings = Settings(broker_url=redis_url, storage_url=f"s3://vlmq-test/e2e-{family}",
                        s3_endpoint_url=s3_server.url, models={name: str(path)})
    worker = WorkerProcess(settings, tmp_path / "worker.log", "--name", f"{family}-{backend}",
                           "--model", name, "--backend", backend)
    try:
        worker.wait_ready()
        assert f"serving {name} on cpu with the {backend} backend" in worker.log()
        with Client(settings=settings) as client:
            jobs = [client.submit(data, f"what is in {i}?", model=name, max_new_tokens=MAX_NEW)
                    for i, data in enumerate(images)]
            results = [job.result(timeout=300) for job in jobs]
        assert [r.token_ids for r in results] == answers
        assert all(r.worker == f"{family}-{backend}" for r in results)
    finally:
        worker.stop()
