"""Batch files in the OpenAI Batch format against a real Redis-compatible server and file storage (no worker)."""
from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
import threading
import tracemalloc
from pathlib import Path

import pytest
from PIL import Image

from vlmq import batch as batches
from vlmq import keys
from vlmq.batch import BatchInvalid, BatchStatus
from vlmq.client import Client
from vlmq.errors import InvalidRequest
from vlmq.jobs import JobStatus


def png(width: int = 64, height: int = 48) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (200, 40, 40)).save(buf, "PNG")
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def line(custom_id: str, image: str, text: str = "How many shapes?", **body: object) -> str:
    content = [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": image}}]
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "tiny-shapes", "messages": [{"role": "user", "content": content}],
                                "max_tokens": 4, **body}})


@pytest.fixture
def client(redis_client: object, redis_url: str, tmp_path: Path) -> Client:
    with Client(redis_url, f"file://{tmp_path / 'store'}") as c:
        yield c


def queued(client: Client) -> int:
    return sum(client.queue_depth("tiny-shapes", c) for c in ("xs", "s", "m", "l", "xl"))


# OpenAI's documented batch input example (platform.openai.com/docs/guides/batch), byte for byte, with its user
# message given as text and image_url parts and its model named tiny-shapes
OPENAI_EXAMPLE = (
    '{"custom_id": "request-1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "tiny-shapes", '
    '"messages": [{"role": "system", "content": "You are a helpful assistant."},{"role": "user", "content": '
    '[{"type": "text", "text": "Hello world!"}, {"type": "image_url", "image_url": {"url": "IMAGE", '
    '"detail": "low"}}]}],"max_tokens": 1000}}\n'
    '{"custom_id": "request-2", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "tiny-shapes", '
    '"messages": [{"role": "system", "content": "You are an unhelpful assistant."},{"role": "user", "content": '
    '[{"type": "text", "text": "Hello world!"}, {"type": "image_url", "image_url": {"url": "IMAGE", '
    '"detail": "low"}}]}],"max_tokens": 1000}}\n'
)


def test_openai_documented_example_is_accepted(client: Client, tmp_path: Path) -> None:
    path = tmp_path / "batchinput.jsonl"
    path.write_text(OPENAI_EXAMPLE.replace("IMAGE", data_url(png())))
    batch = client.submit_batch(path)
    obj = batch.refresh()
    assert obj["status"] == "in_progress" and obj["object"] == "batch"
    assert obj["request_counts"] == {"total": 2, "completed": 0, "failed": 0, "cancelled": 0,
                                       "rejected": 0}
    assert obj["expires_at"] - obj["created_at"] == 24 * 3600 and obj["endpoint"] == "/v1/chat/completions"
    records = [client.job(j.decode()).info() for j in client.redis.lrange(keys.batch_jobs(batch.id), 0, -1)]
    assert [r["custom_id"] for r in records] == ["request-1", "request-2"]
    # the system turn stays a system turn (rendered where the chat template puts it), not glued into the user's
    # text; the image keeps its detail, which the worker applies
    assert json.loads(records[0]["messages"]) == [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": [{"type": "text", "text": "Hello world!"}, {"type": "image", "detail": "low"}]}]
    assert "prompt" not in records[0] and records[0]["image_count"] == "1"
    assert records[1]["max_new_tokens"] == "1000" and records[1]["batch_id"] == batch.id
    assert queued(client) == 2


def test_each_bad_line_is_refused_alone_with_its_number_and_the_rest_run(client: Client, tmp_path: Path) -> None:
    image = tmp_path / "img.png"
    image.write_bytes(png())
    good = [line(f"ok-{i}", "img.png" if i % 2 else data_url(png(40 + i, 40))) for i in range(20)]
    bad = [
        "{not json", json.dumps([1, 2]), line("", "img.png"), line("x1", "img.png").replace('"POST"', '"GET"'),
        line("x2", "img.png").replace("/v1/chat/completions", "/v1/embeddings"),
        line("x3", "https://example.com/cat.png"), line("x4", "http://169.254.169.254/latest"),
        line("x5", "missing.png"), line("x6", "data:image/png;base64,!!!"), line("x7", "img.png", max_tokens=0),
        line("x8", "img.png", max_tokens=10**6), line("x9", "img.png", text="<|image_pad|>"),
        line("ok-3", "img.png"),  # a custom_id used by an earlier line
        line("x10", "img.png").replace('"tiny-shapes"', '"gpt-4o"'), line("x11", "img.png", n=17),
        line("x12", "img.png", tools=[]), line("x13", "s3://elsewhere/cat.png"),
        line("x14", data_url(b"GIF89a not really")),
        # text-only and assistant turns are requests now (issue 29): these two are too many images and a bad part
        json.dumps({"custom_id": "x15", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"model": "tiny-shapes", "messages": [{"role": "user", "content": [
                        {"type": "image_url", "image_url": {"url": "img.png"}}] * 17}]}}),
        json.dumps({"custom_id": "x16", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"model": "tiny-shapes", "messages": [{"role": "user", "content": [
                        {"type": "picture", "picture": "img.png"}]}]}}),
    ]
    assert len(bad) == 20
    lines = good[:10] + bad[:10] + [""] + good[10:] + bad[10:]  # a blank line is skipped but counted
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(lines) + "\n")
    batch = client.submit_batch(path, completion_window="1h")
    expected = list(range(11, 21)) + list(range(32, 42))
    rejected = batch.rejected()
    assert [r["response"]["body"]["error"]["line"] for r in rejected] == expected
    codes = {r["response"]["body"]["error"]["line"]: r["response"]["body"]["error"]["code"] for r in rejected}
    assert codes[11] == "bad_json" and codes[16] == "fetch_refused"  # nothing fetched unless allowed (vlmq.remote)
    assert codes[14] == "bad_method" and codes[17] == "fetch_refused" and codes[18] == "image_not_found"
    assert codes[34] == "duplicate_custom_id" and codes[35] == "unknown_model" and codes[38] == "fetch_refused"
    assert codes[40] == "image_count" and codes[41] == "bad_messages", codes
    first = rejected[0]  # OpenAI's error line for a request refused with HTTP 400, and vlmq's line and retryable
    assert first["custom_id"] is None and first["error"] is None and first["response"]["status_code"] == 400
    assert set(first["response"]["body"]["error"]) == {"message", "type", "param", "code", "line", "retryable"}
    assert first["response"]["body"]["error"]["retryable"] is False
    assert [r["custom_id"] for r in rejected[2:4]] == [None, "x1"]  # an empty custom_id is none; x1's is kept
    assert queued(client) == 20 and len(client.redis.keys(keys.job("*"))) == 20
    assert batch.refresh()["request_counts"] == {"total": 40, "completed": 0, "failed": 20, "cancelled": 0,
                                                 "rejected": 20}
    ended = batch.cancel()
    assert ended["status"] == "cancelled" and ended["request_counts"]["failed"] == 40
    error_file = [json.loads(x) for x in batch.download("error").splitlines()]
    assert error_file[:20] == rejected and len(error_file) == 40  # refused lines first, then the cancelled jobs
    assert {x["error"]["code"] for x in error_file[20:]} == {"batch_cancelled"}
    assert sorted(x["custom_id"] for x in error_file[20:]) == sorted(f"ok-{i}" for i in range(20))
    # all or nothing on request, and the settings' share: 20 bad of 40 passes 0.4
    for kwargs in ({"max_bad_share": 0.0}, {"max_bad_share": 0.4}):
        with pytest.raises(BatchInvalid) as err:
            client.submit_batch(path, **kwargs)
        assert [e.line for e in err.value.errors] == expected and err.value.refused == 20
        assert "line 11: bad_json" in str(err.value) and "line 16: fetch_refused" in str(err.value)
        assert "20 line(s) of the batch file were refused of 40, more than the" in str(err.value)
        failed = client.batch(err.value.batch_id)
        obj = failed.refresh()
        assert obj["status"] == "failed" and [e["line"] for e in obj["errors"]["data"]] == expected
        assert [json.loads(x) for x in failed.download("error").splitlines()] == \
            [r | {"id": r["id"].replace(batch.id, failed.id), "response": r["response"] | {
                "request_id": r["response"]["request_id"].replace(batch.id, failed.id)}} for r in rejected]
    assert queued(client) == 20  # the cancelled batch's messages (a worker drops them), none of the refused files'


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def test_what_enqueueing_would_fail_on_is_refused_at_parse_time_with_the_lines_number(client: Client,
                                                                                      tmp_path: Path) -> None:
    # Issue 36 item 6: line 501's lone surrogate used to pass every rule and fail UTF-8 at enqueue, after the first
    # 500 jobs were enqueued; deep nesting raised RecursionError out of submit_batch
    (tmp_path / "img.png").write_bytes(png())
    good = [line(f"ok-{i}", "img.png") for i in range(500)]
    bad = [line("x1", "img.png", text="What is \ud800?"),  # json.dumps writes the escape "\ud800"
           line("\udc80", "img.png"),
           line("x3", "img.png").replace('"max_tokens": 4', f'"stop": {nested(100_000)}, "max_tokens": 4'),
           line("x4", "img.png").replace('"max_tokens": 4', f'"stop": {nested(33)}, "max_tokens": 4'),
           line("x5", "img\u0000.png"), line("x6", "img\ud800.png"), line("x7", "data:image/png;base64,\u00e9")]
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(good + bad) + "\n")
    with pytest.raises(BatchInvalid) as err:
        client.submit_batch(path, metadata={"team": "vision"}, max_bad_share=0)
    codes = {e.line: e.code for e in err.value.errors}
    assert codes == {501: "bad_prompt", 502: "bad_custom_id", 503: "bad_json", 504: "bad_json",
                     505: "bad_image_source", 506: "bad_image_source", 507: "bad_image_source"}, codes
    assert "line 501: bad_prompt: messages[0].content[0].text is not valid Unicode text" in str(err.value)
    assert "nested deeper than 32 levels" in str(err.value)
    assert queued(client) == 0 and not client.redis.keys(keys.job("*"))
    assert client.batch(err.value.batch_id).refresh()["status"] == "failed"
    with pytest.raises(InvalidRequest) as bad_metadata:
        client.submit_batch(path, metadata={"team": {"nested": "dict"}})  # type: ignore[dict-item]
    assert bad_metadata.value.code == "bad_metadata"
    batch = client.submit_batch(path)  # 7 bad lines of 507: refused alone, the 500 others enqueued
    assert batch.refresh()["request_counts"] == {"total": 507, "completed": 0, "failed": 7, "cancelled": 0,
                                                 "rejected": 7} and queued(client) == 500
    rejected = {r["response"]["body"]["error"]["line"]: r for r in batch.rejected()}
    assert {n: r["response"]["body"]["error"]["code"] for n, r in rejected.items()} == codes
    assert [rejected[n]["custom_id"] for n in (501, 502, 504, 505)] == ["x1", None, "x4", "x5"]


def test_submit_refuses_text_that_is_not_utf8_as_invalid_request(client: Client) -> None:
    cases = [({"prompt": "What is \ud800?"}, "bad_prompt"), ({"idempotency_key": "k\ud800"}, "bad_idempotency_key"),
             ({"webhook": "https://hooks.example.com/\ud800"}, "bad_webhook"),
             ({"image": "img\x00.png"}, "bad_image_source"), ({"image": "data:image/png;base64,\u00e9"},
                                                                "bad_image_source")]
    for change, code in cases:
        request = {"image": png(), "prompt": "How many shapes?"} | change
        with pytest.raises(InvalidRequest) as err:
            client.submit(request.pop("image"), request.pop("prompt"), **request)
        assert err.value.code == code, (change, err.value)
        with pytest.raises(InvalidRequest) as err:
            client.submit_many([{"image": png(), "prompt": "How many shapes?"} | change])
        assert err.value.code == code
    assert queued(client) == 0 and not client.redis.keys(keys.job("*"))


def test_local_paths_stay_in_the_batch_files_folder_unless_the_caller_opts_in(client: Client, tmp_path: Path) -> None:
    # Issue 36 item 7: a batch file could have any image on the producer's disk described, and tell files that
    # exist from files that do not
    folder = tmp_path / "batch"
    (folder / "sub").mkdir(parents=True)
    (folder / "img.png").write_bytes(png())
    secret = tmp_path / "secret.png"
    secret.write_bytes(png(90, 30))
    (folder / "link.png").symlink_to(secret)
    outside = ["../secret.png", str(secret), f"file://{secret}", "link.png", "sub/../../secret.png",
               "../missing.png", str(tmp_path / "missing.png"), "/etc/passwd"]
    inside = ["img.png", "sub/../img.png", f"file://{folder / 'img.png'}", str(folder / "img.png")]
    path = folder / "requests.jsonl"
    path.write_text("".join(line(f"r{i}", ref) + "\n" for i, ref in enumerate(outside + inside)))
    with pytest.raises(BatchInvalid) as err:
        client.submit_batch(path)
    codes = {e.line: e.code for e in err.value.errors}
    assert codes == {n: "image_outside_folder" for n in range(1, len(outside) + 1)}, codes  # missing or not alike
    assert "allow_outside_paths=True" in str(err.value) and queued(client) == 0
    path.write_text("".join(line(f"r{i}", ref) + "\n" for i, ref in enumerate(outside[:5] + inside)))
    batch = client.submit_batch(path, allow_outside_paths=True)  # the caller trusts this file
    assert batch.refresh()["request_counts"]["total"] == 9 and queued(client) == 9


def test_only_regular_files_are_read_and_a_fifo_does_not_hang_submit(client: Client, tmp_path: Path) -> None:
    (tmp_path / "img.png").write_bytes(png())
    (tmp_path / "folder.png").mkdir()
    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(line(f"r{i}", ref) + "\n" for i, ref in enumerate(["pipe.png", "folder.png", "img.png"])))
    outcome: list[BaseException] = []

    def submit() -> None:
        try:
            client.submit_batch(path)
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread
            outcome.append(e)

    worker = threading.Thread(target=submit, daemon=True)
    worker.start()
    worker.join(30)
    if worker.is_alive():  # the old code blocks in open() until a writer comes: be that writer, then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(30)
        pytest.fail("submit_batch hung opening a FIFO")
    [err] = outcome
    assert isinstance(err, BatchInvalid), err
    assert {e.line: e.code for e in err.errors} == {1: "bad_image_source", 2: "bad_image_source"}
    assert str(err).count("is not a regular file") == 2 and queued(client) == 0
    with pytest.raises(InvalidRequest, match="not a regular file"):
        client.submit(str(fifo), "How many shapes?")
    path.write_text("".join(line(f"r{i}", ref) + "\n" for i, ref in enumerate(["/dev/zero", "/dev/null"])))
    with pytest.raises(BatchInvalid) as devices:  # devices are refused even when the caller trusts the file
        client.submit_batch(path, allow_outside_paths=True)
    assert [(e.code, "is not a regular file" in e.message) for e in devices.value.errors] == \
        [("bad_image_source", True)] * 2


def test_an_image_named_by_many_lines_is_read_and_held_once(client: Client, tmp_path: Path) -> None:
    side = 2240  # an incompressible PNG of about 15 MB
    buf = io.BytesIO()
    Image.frombytes("RGB", (side, side), os.urandom(side * side * 3)).save(buf, "PNG", compress_level=0)
    big = buf.getvalue()
    assert 14e6 < len(big) < 16e6
    (tmp_path / "big.png").write_bytes(big)
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(line(f"r{i}", "big.png") + "\n" for i in range(20)))
    assert path.stat().st_size < 6000
    del big, buf
    tracemalloc.start()
    try:
        batch = client.submit_batch(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert batch.refresh()["request_counts"]["total"] == 20 and queued(client) == 20
    assert peak < 4 * 15e6, f"submit_batch held {peak / 2**20:.0f} MiB for one 15 MB image named 20 times"
    stored = list((tmp_path / "store").rglob("inputs/*"))
    assert len(stored) == 1 and stored[0].stat().st_size == (tmp_path / "big.png").stat().st_size


def test_cancel_stops_every_queued_request_with_consistent_counts(client: Client, tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(line(f"r{i}", data_url(png(40 + i, 40))) + "\n" for i in range(30)))
    batch = client.submit_batch(path, completion_window="1h")
    obj = batch.cancel()
    assert obj["status"] == "cancelled" and obj["cancelled_at"] >= obj["cancelling_at"]
    assert obj["request_counts"] == {"total": 30, "completed": 0, "failed": 30, "cancelled": 30,
                                       "rejected": 0}
    assert batch.download("output") == b""
    errors = [json.loads(x) for x in batch.download("error").splitlines()]
    assert [e["custom_id"] for e in errors] == [f"r{i}" for i in range(30)]
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"} and all(e["response"] is None for e in errors)
    job_ids = [j.decode() for j in client.redis.lrange(keys.batch_jobs(batch.id), 0, -1)]
    assert all(client.job(j).status() is JobStatus.CANCELED for j in job_ids)
    assert batch.cancel()["status"] == "cancelled"  # a second cancel changes nothing


def test_every_batch_object_parses_as_the_openai_packages_batch(client: Client, tmp_path: Path) -> None:
    from openai.types import Batch

    path = tmp_path / "requests.jsonl"
    path.write_text("".join(line(f"r{i}", data_url(png(40 + i, 40))) + "\n" for i in range(3)))
    batch = client.submit_batch(path, metadata={"team": "vision"})
    running = Batch.model_validate(batch.refresh(), strict=True)
    assert running.status == "in_progress" and running.input_file_id == str(path) and running.output_file_id is None
    assert running.metadata == {"team": "vision"} and running.request_counts.total == 3
    done = Batch.model_validate(batch.cancel(), strict=True)
    assert done.status == "cancelled" and done.request_counts.failed == 3
    assert (done.output_file_id, done.error_file_id) == (f"file-{batch.id}.output", f"file-{batch.id}.errors")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    with pytest.raises(BatchInvalid) as refused:
        client.submit_batch(bad)
    failed = Batch.model_validate(client.batch(refused.value.batch_id).refresh(), strict=True)
    assert failed.status == "failed" and failed.output_file_id is None
    assert failed.error_file_id == f"file-{refused.value.batch_id}.errors"
    assert failed.errors is not None and failed.errors.data[0].code == "bad_json"


def test_a_batch_past_its_window_expires_with_its_requests_cancelled(client: Client, tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    path.write_text(line("only", data_url(png())) + "\n")
    batch = client.submit_batch(path, completion_window="1s")
    client.redis.hset(keys.batch(batch.id), "expires_at", "0")  # the window has passed
    assert batch.status() is BatchStatus.EXPIRED
    [error] = [json.loads(x) for x in batch.download("error").splitlines()]
    assert error["custom_id"] == "only" and error["error"]["code"] == "batch_expired"


def test_a_job_counts_only_in_a_batch_of_its_own_tenant(client: Client, tmp_path: Path) -> None:
    from vlmq import store

    path = tmp_path / "requests.jsonl"
    path.write_text(line("only", data_url(png())) + "\n")
    batch = client.submit_batch(path)
    forged = "acme." + "f" * 32  # another tenant's job whose record names this batch
    client.redis.hset(keys.job(forged), mapping={"id": forged, "status": "queued", "batch_id": batch.id})
    client.redis.expire(keys.job(forged), 60)
    assert store.transition(client.redis, forged, [JobStatus.QUEUED], JobStatus.FAILED)[0]
    assert batch.refresh()["request_counts"]["failed"] == 0
    [own] = [j.decode() for j in client.redis.lrange(keys.batch_jobs(batch.id), 0, -1)]
    assert store.transition(client.redis, own, [JobStatus.QUEUED], JobStatus.FAILED)[0]
    assert batch.refresh()["request_counts"] == {"total": 1, "completed": 0, "failed": 1, "cancelled": 0,
                                                        "rejected": 0}
    assert batch.status() is BatchStatus.COMPLETED  # finalized by the status read: every request ended


def test_a_tenants_acl_user_submits_cancels_and_finalizes_its_batch(redis_client, redis_url: str,
                                                                     tmp_path: Path) -> None:
    from vlmq import acl

    user = acl.tenant_user("acme")
    redis_client.execute_command("ACL", "SETUSER", *acl.setuser_args(user, "pw", acl.tenant_rules("acme")))
    try:
        path = tmp_path / "requests.jsonl"
        path.write_text(line("a", data_url(png())) + "\n" + line("b", data_url(png(80, 40))) + "\n")
        with Client(redis_url.replace("redis://", f"redis://{user}:pw@"), f"file://{tmp_path / 'store'}",
                    tenant="acme") as client:
            batch = client.submit_batch(path)
            assert batch.id.startswith("acme.batch_") and queued(client) == 2
            assert batch.cancel()["status"] == "cancelled"
            assert len(batch.download("error").splitlines()) == 2
            assert (tmp_path / "store" / keys.batch_object(batch.id, "errors.jsonl")).is_file()
    finally:
        redis_client.execute_command("ACL", "DELUSER", user)


def test_a_batch_with_a_webhook_queues_one_batch_completed_event_when_it_ends(client: Client, tmp_path: Path) -> None:
    from vlmq import webhooks

    path = tmp_path / "requests.jsonl"
    path.write_text(line("a", data_url(png())) + "\n")
    with pytest.raises(InvalidRequest) as err:
        client.submit_batch(path, webhook="http://169.254.169.254/latest")
    assert err.value.code == "bad_webhook"
    batch = client.submit_batch(path, webhook="https://1.1.1.1/hooks/vlmq")
    [job_id] = [j.decode() for j in client.redis.lrange(keys.batch_jobs(batch.id), 0, -1)]
    assert client.job(job_id).info()["webhook"] == ""  # its requests send no job events of their own
    assert batch.cancel()["status"] == "cancelled"
    event = client.redis.hgetall(keys.webhook_event(webhooks.event_id("batch.completed", batch.id)))
    assert event[b"type"] == b"batch.completed" and event[b"url"] == b"https://1.1.1.1/hooks/vlmq"
    data = json.loads(event[b"data"])
    assert data["id"] == batch.id and data["status"] == "cancelled" and data["request_counts"]["failed"] == 1
    client.redis.delete(keys.webhook_due())  # no delivery worker runs here to take the event


def test_a_batch_holds_at_most_what_one_finalization_reads(client: Client, tmp_path: Path) -> None:
    path = tmp_path / "big.jsonl"
    path.write_text((line("x", "img.png") + "\n") * (batches.MAX_REQUESTS + 1))  # refused before any is parsed
    with pytest.raises(InvalidRequest) as err:
        client.submit_batch(path)
    assert err.value.code == "batch_too_large" and f"at most {batches.MAX_REQUESTS}" in str(err.value)
    assert queued(client) == 0 and not list(client.redis.scan_iter(keys.batch("*")))


def distinct_png(i: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (32 + i % 64, 32 + i // 64 % 64), (i % 251, i // 251 % 251, 90)).save(buf, "PNG")
    return buf.getvalue()


def mixed_file(path: Path, n: int) -> Path:
    """``n`` lines: half a distinct image each (data: URLs), half one of 50 files beside the batch file; every
    tenth line bad."""
    rows = []
    for i in range(n):
        if i % 10 == 9:
            rows.append(line(f"bad-{i}", "missing.png") if i % 20 == 9 else "{not json")
        elif i % 2:
            (path.parent / f"img{i % 100}.png").write_bytes(distinct_png(i % 100))
            rows.append(line(f"r{i}", f"img{i % 100}.png"))
        else:
            rows.append(line(f"r{i}", data_url(distinct_png(i))))
    path.write_text("\n".join(rows) + "\n")
    return path


PEAK_SCRIPT = """
import json, sys, tracemalloc
from vlmq.client import Client
with Client(sys.argv[1], sys.argv[2]) as client:
    tracemalloc.start()
    batch = client.submit_batch(sys.argv[3])
    peak = tracemalloc.get_traced_memory()[1]
    print(json.dumps({"peak": peak, "counts": batch.refresh()["request_counts"]}))
"""


def test_the_producers_memory_does_not_grow_with_the_batch_file(client: Client, redis_url: str,
                                                                 tmp_path: Path) -> None:
    # Issue 29 item 5: submit_batch held every line and every image of the file until the whole file was checked.
    # Each size is submitted by a fresh producer process, so what one run leaves behind does not count in another's
    peaks = {}
    for n in (600, 2400):
        folder = tmp_path / str(n)
        folder.mkdir()
        path = mixed_file(folder / "requests.jsonl", n)
        run = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, redis_url, f"file://{tmp_path / 'store'}",
                              str(path)], capture_output=True, text=True, timeout=300, check=True)
        report = json.loads(run.stdout)
        assert report["counts"]["rejected"] == n // 10 and report["counts"]["total"] == n
        peaks[n] = report["peak"]
    assert queued(client) == (600 + 2400) * 9 // 10
    grown = peaks[2400] - peaks[600]
    print(f"submit_batch peak (tracemalloc): {peaks[600] / 2**20:.1f} MiB for 600 lines, "
          f"{peaks[2400] / 2**20:.1f} MiB for 2400")
    # what may grow: the refused lines' error lines (read whole to be stored), here 180 more of them (~70 KiB);
    # the rest is the allocator's noise (about 1 MiB either way). Holding every line, as submit_batch did, adds
    # about 3 KiB per good line: 5 MiB for these 1,620 more
    assert grown < 3 << 19, f"peak {peaks[600] / 2**20:.1f} MiB for 600 lines, {peaks[2400] / 2**20:.1f} MiB " \
        "for 2400"


def test_submit_many_can_refuse_bad_requests_alone(client: Client) -> None:
    requests = [{"image": png(), "prompt": "How many shapes?"}, {"image": b"not an image", "prompt": "x"},
                {"image": png(50, 50), "prompt": "What color?", "max_new_tokens": 0},
                {"messages": [{"role": "user", "content": "Say hi"}]}]
    with pytest.raises(InvalidRequest, match="request 1: ") as err:
        client.submit_many(requests)
    assert err.value.code == "not_an_image" and queued(client) == 0
    outcome = client.submit_many(requests, on_error="collect")
    assert [type(x).__name__ for x in outcome] == ["Job", "InvalidRequest", "InvalidRequest", "Job"]
    assert [outcome[1].code, outcome[2].code] == ["not_an_image", "bad_max_new_tokens"]
    assert str(outcome[2]).startswith("request 2: ") and queued(client) == 2
    assert outcome[3].info()["status"] == JobStatus.QUEUED.value


def test_a_line_that_is_not_utf8_is_refused_alone(client: Client, tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    good = [line(f"r{i}", data_url(png())).encode() for i in range(3)]
    path.write_bytes(b"\n".join(good[:2] + [line("bad", data_url(png())).encode()[:-20] + b"\xff\xfe\"}}"] +
                                good[2:]) + b"\n")
    batch = client.submit_batch(path)
    [refused] = batch.rejected()
    assert refused["response"]["body"]["error"]["code"] == "bad_json" and refused["response"]["body"]["error"][
        "line"] == 3 and queued(client) == 3


def test_a_lines_account_fields_are_kept_and_its_tier_sets_its_priority(client: Client, tmp_path: Path) -> None:
    image = data_url(png())
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join([line("flex", image, service_tier="flex", user="ana", metadata={"doc": "7"}),
                               line("fast", image, service_tier="priority", store=True), line("plain", image)]) + "\n")
    batch = client.submit_batch(path, priority=5)
    records = {r["custom_id"]: r for r in (client.job(j.decode()).info() for j in
                                           client.redis.lrange(keys.batch_jobs(batch.id), 0, -1))}
    assert {k: r["priority"] for k, r in records.items()} == {"flex": "7", "fast": "3", "plain": "5"}
    assert records["flex"]["user"] == "ana" and json.loads(records["flex"]["metadata"]) == {"doc": "7"}
    assert "user" not in records["plain"] and "service_tier" not in records["plain"]
    doc = {"model": "tiny-shapes", "text": "3", "finish_reason": "stop",
           "usage": {"prompt_tokens": 9, "generated_tokens": 1}}
    body = batches.output_line(records["flex"], doc)["response"]["body"]
    assert body["service_tier"] == "flex" and body["metadata"] == {"doc": "7"}
    assert "metadata" not in batches.output_line(records["plain"], doc)["response"]["body"]
    forged = records["plain"] | {"metadata": "[not an object"}
    assert "metadata" not in batches.output_line(forged, doc)["response"]["body"]
