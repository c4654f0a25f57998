"""Batch files end to end: a 1,000-line OpenAI-format batch with bad lines through a real worker, and cancel
mid-batch. Its images are ``data:`` URLs, files beside the batch file, ``s3://`` objects and ``https://`` URLs on a
real TLS image server on loopback (allow-listed for this pool only), which the worker fetches."""
from __future__ import annotations

import base64
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import inputs
import pytest
from imageserver import ImageServer, Route
from test_webhook_https import LOCAL, make_cert, server_context
from workerproc import TINY_CLASSES, ready_worker

from vlmq import keys
from vlmq.client import Client
from vlmq.jobs import JobStatus
from vlmq.settings import Settings

LINES = int(os.environ.get("VLMQ_BATCH_LINES", "1000"))  # the full run: VLMQ_BATCH_LINES=50000
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600 + LINES // 20)]


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def request(custom_id: str, image: str, max_tokens: int) -> str:
    content = [{"type": "text", "text": "How many shapes?"}, {"type": "image_url", "image_url": {"url": image}}]
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "tiny-shapes", "messages": [{"role": "user", "content": content}],
                                "max_tokens": max_tokens}}) + "\n"


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ImageServer]:
    """A TLS image server on loopback; its CA file is ``ca_file``."""
    folder = tmp_path_factory.mktemp("tls")
    ca, ca_cert, ca_key = make_cert(folder, "ca", [], ca=True)
    good = make_cert(folder, "good", ["localhost", "127.0.0.1"], (ca_cert, ca_key))[0]
    server = ImageServer(LOCAL, server_context(good, []))
    server.ca_file = str(ca.cert)  # type: ignore[attr-defined]
    yield server
    server.stop()


@pytest.fixture(scope="module")
def pool(redis_url: str, s3_server, images: ImageServer,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    settings = Settings(broker_url=redis_url, storage_url="s3://vlmq-test/e2e-batch", s3_endpoint_url=s3_server.url,
                        cost_classes=TINY_CLASSES, worker_batch=32, image_fetch_allow="localhost",
                        image_fetch_networks="127.0.0.1/32 ::1/128",
                        image_fetch_ca_file=images.ca_file)  # type: ignore[attr-defined]
    with ready_worker(redis_url, settings, tmp_path_factory.mktemp("batch") / "worker.log"):
        yield settings


def lines_of(data: bytes) -> list[dict]:
    return [json.loads(x) for x in data.splitlines()]


def bad_line(i: int, kind: int, good: str) -> tuple[str, str]:
    """One of 12 kinds of line refused at submit, and its code."""
    body = json.loads(good)
    cases = [
        ("bad_json", good[:-3]), ("bad_custom_id", good.replace(f'"req-{i}"', '""')),
        ("bad_method", good.replace('"POST"', '"GET"')), ("bad_url", good.replace("/chat/completions", "/embeddings")),
        ("unknown_model", good.replace('"tiny-shapes"', '"gpt-4o"')),
        ("image_not_found", request(f"req-{i}", "missing.png", 2).rstrip()),
        ("not_an_image", request(f"req-{i}", data_url(b"plain text, not an image"), 2).rstrip()),
        ("bad_image_source", request(f"req-{i}", "data:image/png;base64,!!!", 2).rstrip()),
        ("duplicate_custom_id", good.replace(f'"req-{i}"', '"req-0"')),
        ("bad_max_new_tokens", good.replace('"max_tokens": 2', '"max_tokens": 0')),
        ("unsupported_field", json.dumps(body | {"body": body["body"] | {"tools": []}})),
        ("image_count", json.dumps(body | {"body": body["body"] | {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "img0.png"}}] * 17}]}})),
    ]
    code, text = cases[kind % len(cases)]
    return code, text + "\n"


def test_a_batch_file_runs_every_good_line_and_reports_every_bad_one(pool: Settings, images: ImageServer,
                                                                      tmp_path: Path) -> None:
    # issue 29 item 5: bad lines of 12 kinds go to the error file with their codes, the rest run; images are
    # data: URLs, files beside the batch file, s3:// objects and https:// URLs, LINES // 25 distinct ones
    distinct = max(8, LINES // 25)
    broken = data_url(inputs.corrupt_png_data())  # a valid header: refused by the worker, not at submit
    path = tmp_path / "requests.jsonl"
    expected: dict[str, str] = {}  # custom_id (or line number) -> the error code of its line
    with Client(settings=pool) as client:
        sources = []
        for k in range(distinct):
            image = inputs.encode(inputs.rgb(32 + k % 40, 32 + k // 40 % 50), "PNG")
            if k % 4 == 1:
                (tmp_path / f"img{k}.png").write_bytes(image)
                sources.append(f"img{k}.png")
            elif k % 4 == 2:
                client.storage.put(f"uploads/img{k}.png", image)
                sources.append(f"{client.storage.url}/uploads/img{k}.png")
            elif k % 4 == 3:
                images.routes[f"/img{k}.png"] = Route(image)
                sources.append(images.url(f"/img{k}.png"))
            else:
                sources.append(data_url(image))
        (tmp_path / "img0.png").write_bytes(inputs.encode(inputs.rgb(40, 40), "PNG"))
        with open(path, "w") as f:
            for i in range(LINES):
                good = request(f"req-{i}", broken if i % 200 == 7 else sources[i % distinct], 2)
                if i % 100 == 50:
                    code, text = bad_line(i, i // 100, good.rstrip())
                    expected[f"line-{i + 1}"] = code
                    good = text
                elif i % 200 == 7:
                    expected[f"req-{i}"] = "corrupt_image"
                f.write(good)
        t0 = time.monotonic()
        batch = client.submit_batch(path)
        submitted = time.monotonic() - t0
        rejected = len([k for k in expected if k.startswith("line-")])
        assert batch.refresh()["request_counts"]["rejected"] == rejected
        obj = batch.wait(timeout=120 + LINES * 0.2)
        elapsed = time.monotonic() - t0
        assert obj["status"] == "completed", obj
        assert obj["request_counts"] == {"total": LINES, "completed": LINES - len(expected),
                                         "failed": len(expected), "cancelled": 0, "rejected": rejected}
        out, err = lines_of(batch.download("output")), lines_of(batch.download("error"))
    good_ids = {f"req-{i}" for i in range(LINES) if f"req-{i}" not in expected and i % 100 != 50}
    assert sorted(x["custom_id"] for x in out) == sorted(good_ids)  # each good line once
    codes = {}
    for x in err:  # each bad line once, with its code: refused at submit (OpenAI's 400 shape) or by the worker
        if x["response"] is not None:
            error = x["response"]["body"]["error"]
            assert x["response"]["status_code"] == 400 and error["retryable"] is False
            key, code = f"line-{error['line']}", error["code"]
        else:
            key, code = x["custom_id"], x["error"]["code"]
        assert key not in codes, key
        codes[key] = code
    assert codes == expected
    assert len(set(expected.values())) >= 11  # 10 kinds refused at submit (12 from 1,200 lines), 1 by the worker
    first = out[0]
    assert first["custom_id"] == "req-0" and first["error"] is None and first["response"]["status_code"] == 200
    body = first["response"]["body"]
    assert body["object"] == "chat.completion" and body["model"] == "tiny-shapes"
    assert body["usage"]["completion_tokens"] <= 2 and body["choices"][0]["finish_reason"] in ("stop", "length")
    assert obj["output_file_id"] == f"file-{batch.id}.output" and obj["error_file_id"] == f"file-{batch.id}.errors"
    fetched = [path for path, wanted in images.requests if not wanted]  # the workers' full GETs (submit: ranged)
    assert fetched and all(path in images.routes for path in fetched)
    print(f"{LINES}-line batch ({rejected} lines refused): submit {submitted:.1f} s, done {elapsed:.1f} s")


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
