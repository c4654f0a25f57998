"""Chat jobs end to end (issue 29 items 1-2): a real Valkey, file storage and a real worker process with the bundled
model. A two-image chat with system and assistant turns, a text-only chat, a batch line of several images and the
``(image, prompt)`` shortcut each get the answer the engine gives for the same messages directly; the price at
submit is the image tokens the worker's engine counted."""
from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import pytest
from tiny.shapes import make_split
from workerproc import ready_worker

from vlmq.client import Client
from vlmq.errors import InvalidRequest
from vlmq.images import decode
from vlmq.request import JobRequest
from vlmq.settings import Settings
from vlmq.workers.engine.engine import Engine, Request
from vlmq.workers.main import ASSETS

pytestmark = pytest.mark.timeout(600)
MAX_NEW = 16


def png(image: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def text(value: str) -> dict[str, str]:
    return {"type": "text", "text": value}


def image_url(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def engine_form(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same chat as the engine takes it: each image part ``{"type": "image"}``."""
    def part(p: dict[str, Any]) -> dict[str, Any]:
        return {"type": "image"} if p["type"] == "image_url" else p

    return [m if isinstance(m["content"], str) else {**m, "content": [part(p) for p in m["content"]]}
            for m in messages]


def test_chat_jobs_get_the_engines_own_answers(redis_url: str, tmp_path: Path) -> None:
    images = [png(example.image) for example in make_split(29, 3)]
    (tmp_path / "second.png").write_bytes(images[1])
    two_images = [
        {"role": "system", "content": "You describe shapes."},
        {"role": "user", "content": [image_url(data_url(images[0])), text("Describe the image.")]},
        {"role": "assistant", "content": "a red circle"},
        {"role": "user", "content": [text("And this one?"), image_url(str(tmp_path / "second.png"))]},
    ]
    text_only = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "How many shapes?"}]
    three_images = [{"role": "user", "content": [image_url("second.png"), text("Describe the image."),
                                                 image_url(data_url(images[2])), image_url(data_url(images[0]))]}]
    batch_file = tmp_path / "batch.jsonl"
    batch_file.write_text(json.dumps({"custom_id": "three", "method": "POST", "url": "/v1/chat/completions",
                                      "body": {"model": "tiny-shapes", "max_tokens": MAX_NEW,
                                               "messages": three_images}}) + "\n")
    settings = Settings(broker_url=redis_url, storage_url=(tmp_path / "store").as_uri())
    with ready_worker(redis_url, settings, tmp_path / "worker.log"), Client(settings=settings) as client:
        jobs = client.submit_many([JobRequest(messages=two_images, max_new_tokens=MAX_NEW),
                                   {"messages": text_only, "max_new_tokens": MAX_NEW},
                                   JobRequest(images[2], "Describe the image.", max_new_tokens=MAX_NEW)])
        results = [job.result(timeout=240) for job in jobs]
        records = [job.info() for job in jobs]
        for bad, named in [([{"role": "user", "content": [{"type": "video", "video": "x.mp4"}]}], "type 'video'"),
                           ([{"role": "user", "content": [image_url(data_url(images[0]))] * 17}], "limit is 16"),
                           ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": 3}}]}],
                            "image_url.url")]:
            with pytest.raises(InvalidRequest, match=named):  # refused at submit, by name: never reaches the worker
                client.submit(messages=bad)
        batch = client.submit_batch(batch_file)
        assert batch.wait(timeout=240)["request_counts"]["completed"] == 1
        (line,) = [json.loads(x) for x in batch.download("output").splitlines()]
    pil = [decode(data) for data in images]
    engine = Engine.from_model_dir(Path(ASSETS) / "tiny-shapes")
    direct = engine.generate([
        Request.chat(engine_form(two_images), (pil[0], pil[1]), max_new_tokens=MAX_NEW),
        Request.chat(text_only, (), max_new_tokens=MAX_NEW),
        Request(pil[2], "Describe the image.", max_new_tokens=MAX_NEW),
        Request.chat(engine_form(three_images), (pil[1], pil[2], pil[0]), max_new_tokens=MAX_NEW),
    ])
    for result, record, want in zip(results, records, direct[:3], strict=True):
        assert want.error is None and want.token_ids, want
        assert (result.token_ids, result.text) == (want.token_ids, want.text), record["id"]
        assert result.usage["image_tokens"] == want.image_tokens == int(record["vision_tokens"])
        assert result.usage["prompt_tokens"] == want.prompt_tokens
    assert direct[0].image_tokens > direct[2].image_tokens > 0 and direct[1].image_tokens == 0
    body = line["response"]["body"]  # a batch line of three images, one of them a path beside the batch file
    assert (line["custom_id"], body["choices"][0]["message"]["content"]) == ("three", direct[3].text)
    assert body["usage"]["prompt_tokens"] == direct[3].prompt_tokens and direct[3].image_tokens > direct[0].image_tokens
