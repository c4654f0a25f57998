"""The official ``openai`` package, unmodified, against a real ``vlmq serve``, Valkey, moto's S3 and a worker:
Files, Batches and Chat Completions, every object parsed with the package's own types."""
from __future__ import annotations

import base64
import io
import json
import time

import openai
import pytest
from openai.types import Batch, FileDeleted, FileObject, Model
from openai.types.chat import ChatCompletion
from serveproc import Door

from vlmq.client import Client

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def example(seed: int, size: int = 224) -> tuple[str, str, str]:
    """A held-out scene of the bundled model's task: its data: URL, question and right answer."""
    from tiny.shapes import make_example

    ex = make_example((4242, seed), size=(size, size))
    buf = io.BytesIO()
    ex.image.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode(), ex.question, ex.answer


def messages(url: str, question: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": question}]}]


def batch_file(n: int, max_tokens: int = 16, bad: int = 0) -> bytes:
    lines = []
    for i in range(n):
        url, question, _ = example(i % 8)
        body = {"model": "tiny-shapes", "messages": messages(url, question), "max_tokens": max_tokens}
        lines.append(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
                                 "body": body}))
    lines += [json.dumps({"custom_id": f"bad-{i}", "method": "GET", "url": "/v1/chat/completions", "body": {}})
              for i in range(bad)]
    return "".join(f"{x}\n" for x in lines).encode()


def api(door: Door, key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=door.url, api_key=key or door.key_a, max_retries=0, timeout=120)


def strict(model: type, value: object) -> object:
    """What the package's own type makes of the raw JSON (``strict``: no coercion of ours to hide behind)."""
    return model.model_validate(value, strict=True)


def test_files_then_a_batch_then_its_results_through_the_official_client(door: Door) -> None:
    with api(door) as client:
        [model] = client.models.list().data
        assert isinstance(model, Model) and model.id == "tiny-shapes"
        uploaded = client.files.create(file=("requests.jsonl", batch_file(12, bad=2)), purpose="batch")
        raw = client.files.with_raw_response.retrieve(uploaded.id)
        assert strict(FileObject, raw.http_response.json()).bytes == len(batch_file(12, bad=2))
        assert uploaded.filename == "requests.jsonl" and uploaded.purpose == "batch"
        assert uploaded.id in {f.id for f in client.files.list().data}
        assert client.files.content(uploaded.id).read() == batch_file(12, bad=2)
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                      completion_window="24h", metadata={"run": "e2e"})
        assert batch.input_file_id == uploaded.id and batch.metadata == {"run": "e2e"}
        deadline = time.monotonic() + 300
        while batch.status not in ("completed", "failed", "cancelled", "expired") and time.monotonic() < deadline:
            time.sleep(0.5)
            raw = client.batches.with_raw_response.retrieve(batch.id)
            batch = strict(Batch, raw.http_response.json())
        assert batch.status == "completed", batch
        assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (14, 12, 2)
        assert batch.id in {b.id for b in client.batches.list(limit=5).data}
        out_file, err_file = client.files.retrieve(batch.output_file_id), client.files.retrieve(batch.error_file_id)
        assert out_file.purpose == err_file.purpose == "batch_output"
        out = [json.loads(x) for x in client.files.content(batch.output_file_id).read().splitlines()]
        errors = [json.loads(x) for x in client.files.content(batch.error_file_id).read().splitlines()]
        assert sorted(x["custom_id"] for x in out) == sorted(f"req-{i}" for i in range(12))
        assert sorted(x["custom_id"] for x in errors) == ["bad-0", "bad-1"]
        assert out_file.bytes == sum(len(json.dumps(x)) + 1 for x in out) or out_file.bytes > 0
        for line in out:
            completion = strict(ChatCompletion, line["response"]["body"])
            assert completion.choices[0].message.role == "assistant" and completion.usage.total_tokens > 0
        deleted = client.files.delete(uploaded.id)
        assert isinstance(deleted, FileDeleted) and deleted.deleted
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(uploaded.id)


def test_a_chat_completion_with_a_data_image_gets_the_models_right_answer(door: Door) -> None:
    with api(door) as client:
        right = 0
        for seed in range(6):
            url, question, answer = example(seed)
            raw = client.chat.completions.with_raw_response.create(model="tiny-shapes",
                                                                   messages=messages(url, question), max_tokens=24)
            completion = strict(ChatCompletion, raw.http_response.json())
            text = completion.choices[0].message.content
            with Client(settings=door.settings, tenant="acme") as sdk:  # the same request through the SDK
                direct = sdk.submit(messages=messages(url, question), max_new_tokens=24).result(timeout=120).text
            assert text == direct
            right += text == answer
        assert right >= 5, f"{right} of 6 right"


def test_stream_and_unknown_fields_are_refused_by_name(door: Door) -> None:
    with api(door) as client:
        url, question, _ = example(0)
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="tiny-shapes", messages=messages(url, question), stream=True)
        assert refused.value.param == "stream"
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="tiny-shapes", messages=messages(url, question),
                                           extra_body={"frobnicate": 1})
        assert "frobnicate" in refused.value.message
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="gpt-4o", messages=messages(url, question))
        assert refused.value.param == "model" and refused.value.code == "unknown_model"


def test_cancel_mid_run_ends_cancelled_with_consistent_counts(door: Door) -> None:
    with api(door) as client:
        uploaded = client.files.create(file=("big.jsonl", batch_file(300, max_tokens=48)), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        cancelled = client.batches.cancel(batch.id)
            # cancelling; or, when a worker ending the last requests is writing the files just then, finalizing
        assert cancelled.status in ("cancelling", "finalizing", "cancelled")
        deadline = time.monotonic() + 120
        while cancelled.status != "cancelled" and time.monotonic() < deadline:
            time.sleep(0.3)
            cancelled = client.batches.retrieve(batch.id)
        c = cancelled.request_counts
        assert cancelled.status == "cancelled" and c.total == 300 and c.completed + c.failed == 300 and c.failed > 0
        out = client.files.content(cancelled.output_file_id).read().splitlines()
        errors = [json.loads(x) for x in client.files.content(cancelled.error_file_id).read().splitlines()]
        assert len(out) == c.completed and len(errors) == c.failed
        assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
        with pytest.raises(openai.ConflictError):
            done = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                         completion_window="24h")
            while client.batches.retrieve(done.id).status != "completed":
                time.sleep(0.3)
            client.batches.cancel(done.id)
