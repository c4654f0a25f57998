"""Batch files end to end: a 1,000-line OpenAI-format batch through a real worker, and cancel mid-batch."""
from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from pathlib import Path

import inputs
import pytest
from workerproc import TINY_CLASSES, ready_worker

from vlmq import keys
from vlmq.client import Client
from vlmq.jobs import JobStatus
from vlmq.settings import Settings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def request(custom_id: str, image: str, max_tokens: int) -> str:
    content = [{"type": "text", "text": "How many shapes?"}, {"type": "image_url", "image_url": {"url": image}}]
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "tiny-shapes", "messages": [{"role": "user", "content": content}],
                                "max_tokens": max_tokens}}) + "\n"


@pytest.fixture(scope="module")
def pool(redis_url: str, s3_server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    settings = Settings(broker_url=redis_url, storage_url="s3://vlmq-test/e2e-batch", s3_endpoint_url=s3_server.url,
                        cost_classes=TINY_CLASSES, worker_batch=32)
    with ready_worker(redis_url, settings, tmp_path_factory.mktemp("batch") / "worker.log"):
        yield settings


def lines_of(data: bytes) -> list[dict]:
    return [json.loads(x) for x in data.splitlines()]


def test_a_thousand_line_batch_ends_with_one_line_per_request(pool: Settings, tmp_path: Path) -> None:
    images = [data_url(inputs.encode(inputs.rgb(48 + 8 * i, 40), "PNG")) for i in range(8)]
    broken = data_url(inputs.corrupt_png_data())  # a valid header: refused by the worker, not at submit
    path = tmp_path / "requests.jsonl"
    with Client(settings=pool) as client:
        client.storage.put("uploads/seven.png", inputs.encode(inputs.rgb(70, 50), "PNG"))
        sources = images + [f"{client.storage.url}/uploads/seven.png"]
        path.write_text("".join(request(f"req-{i}", broken if i % 200 == 7 else sources[i % len(sources)], 2)
                                for i in range(1000)))
        t0 = time.monotonic()
        batch = client.submit_batch(path)
        obj = batch.wait(timeout=300)
        elapsed = time.monotonic() - t0
        assert obj["status"] == "completed", obj
        assert obj["request_counts"] == {"total": 1000, "completed": 995, "failed": 5, "cancelled": 0}
        out, err = lines_of(batch.download("output")), lines_of(batch.download("error"))
    assert sorted(x["custom_id"] for x in out + err) == sorted(f"req-{i}" for i in range(1000))
    assert [x["custom_id"] for x in err] == [f"req-{i}" for i in range(7, 1000, 200)]
    assert all(x["response"] is None and x["error"]["code"] == "corrupt_image" for x in err), err[0]
    first = out[0]
    assert first["custom_id"] == "req-0" and first["error"] is None and first["response"]["status_code"] == 200
    body = first["response"]["body"]
    assert body["object"] == "chat.completion" and body["model"] == "tiny-shapes"
    assert body["usage"]["completion_tokens"] <= 2 and body["choices"][0]["finish_reason"] in ("stop", "length")
    assert obj["output_file"].endswith(f"batches/{batch.id}/output.jsonl")
    print(f"1000-line batch: {elapsed:.1f} s")


def test_cancel_mid_batch_stops_queued_requests(pool: Settings, tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    image = data_url(inputs.encode(inputs.rgb(64, 48), "PNG"))
    path.write_text("".join(request(f"c{i}", image, 24) for i in range(400)))
    with Client(settings=pool) as client:
        batch = client.submit_batch(path)
        deadline = time.monotonic() + 120
        while batch.refresh()["request_counts"]["completed"] < 10:
            assert time.monotonic() < deadline, "no request of the batch finished in 120 s"
            time.sleep(0.05)
        # cancelling; or, once every request has ended, being finalized (by the worker or by this call) or done
        assert batch.cancel()["status"] in ("cancelling", "finalizing", "cancelled")
        obj = batch.wait(timeout=60)
        assert obj["status"] == "cancelled", obj
        counts = obj["request_counts"]
        assert counts["total"] == 400 and counts["completed"] + counts["failed"] == 400
        assert counts["completed"] >= 10 and counts["cancelled"] == counts["failed"] > 0
        out, err = lines_of(batch.download("output")), lines_of(batch.download("error"))
        assert len(out) == counts["completed"] and len(err) == counts["failed"]
        assert {x["error"]["code"] for x in err} == {"batch_cancelled"}
        # the worker drains the cancelled messages without running them: no result object appears later
        deadline = time.monotonic() + 60
        while client.queue_depth("tiny-shapes", "xs") or client.queue_depth("tiny-shapes", "s"):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        job_ids = [j.decode() for j in client.redis.lrange(keys.batch_jobs(batch.id), 0, -1)]
        statuses = [client.job(j).status() for j in job_ids]
        assert statuses.count(JobStatus.FINISHED) == counts["completed"]
        assert statuses.count(JobStatus.CANCELED) == counts["cancelled"]
        results = client.storage.client.list_objects_v2(Bucket="vlmq-test", Prefix="e2e-batch/results/")
        stored = {o["Key"].rsplit("/", 1)[1][:-5] for o in results.get("Contents", [])}
        assert not stored & {j for j, s in zip(job_ids, statuses, strict=True) if s is JobStatus.CANCELED}
        assert batch.refresh()["request_counts"] == counts
