"""The ``vlmq`` command in-process, against a real Redis-compatible server and file storage (no worker)."""
from __future__ import annotations

import io
import json
import threading
from pathlib import Path

import pytest
from PIL import Image

from vlmq import keys, store
from vlmq.cli import main
from vlmq.client import Client
from vlmq.jobs import JobStatus


def png(width: int = 64, height: int = 48) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (10, 200, 10)).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture
def pool(redis_client: object, redis_url: str, tmp_path: Path) -> tuple[list[str], Client]:
    flags = ["--broker", redis_url, "--storage", f"file://{tmp_path / 'store'}"]
    with Client(redis_url, f"file://{tmp_path / 'store'}") as client:
        yield flags, client


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def finish(client: Client, job_id: str, token_ids: list[int]) -> None:
    """What a worker does when it ends a job."""
    doc = {"job_id": job_id, "model": "tiny-shapes", "text": "two circles", "token_ids": token_ids,
           "finish_reason": "stop", "usage": {"prompt_tokens": 30, "image_tokens": 20, "generated_tokens": 3},
           "timings": {"model": 0.25}, "worker": "w1"}
    client.storage.put(keys.result_object(job_id), json.dumps(doc).encode())
    store.transition(client.redis, job_id, [JobStatus.QUEUED], JobStatus.FINISHED, ttl=60)


def test_help_names_the_environment_variables(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "VLMQ_BROKER_URL" in out and "VLMQ_STORAGE_URL" in out and "--broker" in out and "--storage" in out


def test_read_commands_print_text_by_default_and_json_on_request(pool, capsys, tmp_path: Path) -> None:
    flags, client = pool
    image = tmp_path / "img.png"
    image.write_bytes(png())
    code, out, _ = run(capsys, "submit", str(image), "How many circles?", *flags)
    job_id = out.strip()
    assert code == 0 and client.job(job_id).status() is JobStatus.QUEUED
    code, out, _ = run(capsys, "status", job_id, *flags)
    assert code == 0 and out.startswith(f"job {job_id}: queued") and " ago)" in out
    assert "created_at" not in out and "17" not in out.split("created:")[1][:3]  # a date, not epoch seconds
    code, out, _ = run(capsys, "status", job_id, "--json", *flags)
    assert json.loads(out)["status"] == "queued" and json.loads(out)["id"] == job_id
    finish(client, job_id, [5, 6, 7])
    code, out, _ = run(capsys, "result", job_id, *flags)
    assert code == 0 and out.startswith("two circles\n") and "token ids: [5, 6, 7]" in out
    assert "\n5\n" not in out
    code, out, _ = run(capsys, *flags, "--json", "result", job_id)  # flags before the command work too
    assert json.loads(out)["token_ids"] == [5, 6, 7]


def test_cache_stats_prints_hit_rates_by_default_and_json_on_request(pool, capsys, redis_client) -> None:
    flags, client = pool
    heartbeat = {"model": "tiny-shapes", "classes": "s,xs", "jobs_served": 4, "encoded_images": 1,
                 "prefix_cache_hit_tokens": 48, "prefix_cache_query_tokens": 64, "archive_hits": 0,
                 "archive_misses": 2}
    redis_client.hset(keys.worker_stats("host:3"), mapping=heartbeat)  # as a worker's heartbeat writes it
    redis_client.expire(keys.worker_stats("host:3"), 30)
    client.storage.put(f"{keys.KV_ROOT}abc123/blocks/1", b"x" * 2048)
    code, out, _ = run(capsys, "cache", "stats", *flags)
    assert code == 0 and "  abc123 " not in out and "abc123" in out and "1 objects, 2.0 KiB" in out
    assert "model tiny-shapes: 1 worker(s), 4 jobs served, 1 images encoded" in out
    assert "prefix cache 75%" in out and "archive 0%" in out and "worker host-3 (tiny-shapes, classes s,xs)" in out
    code, out, _ = run(capsys, "cache", "stats", "--json", *flags)
    assert json.loads(out)["models"]["tiny-shapes"]["hit_rates"]["prefix_cache"] == 0.75


def test_wait_and_cancel_exit_codes(pool, capsys) -> None:
    flags, client = pool
    done, failing, slow = (client.submit(png(50 + i, 40), "How many circles?") for i in range(3))
    finish(client, done.id, [1])
    store.transition(client.redis, failing.id, [JobStatus.QUEUED], JobStatus.FAILED,
                       {"error_type": "corrupt_image", "error_message": "bad pixels"})
    assert run(capsys, "wait", done.id, *flags)[0] == 0
    code, out, _ = run(capsys, "wait", done.id, failing.id, *flags)
    assert code == 1 and f"{failing.id}: failed (corrupt_image: bad pixels)" in out
    code, out, _ = run(capsys, "wait", slow.id, "--timeout", "0.2", *flags)
    assert code == 124 and "timeout" in out
    later = threading.Timer(0.3, finish, (client, slow.id, [2]))
    later.start()
    assert run(capsys, "wait", slow.id, "--timeout", "30", *flags)[0] == 0  # woken by the done list
    later.join()
    queued = client.submit(png(90, 40), "How many circles?")
    code, out, _ = run(capsys, "cancel", queued.id, done.id, "--json", *flags)
    assert code == 0 and json.loads(out) == {queued.id: "canceled", done.id: "already ended"}
    assert client.job(queued.id).status() is JobStatus.CANCELED
    assert run(capsys, "cancel", "0" * 32, *flags)[0] == 1


def test_cost_exits_non_zero_when_a_file_is_refused(capsys, tmp_path: Path) -> None:
    good, bad = tmp_path / "good.png", tmp_path / "bad.png"
    good.write_bytes(png())
    bad.write_bytes(b"not an image")
    assert run(capsys, "cost", str(good))[0] == 0
    code, out, err = run(capsys, "cost", str(good), str(bad))
    assert code == 1 and "error: not_an_image" in out and "bad.png" in err
    code, out, _ = run(capsys, "cost", str(good), str(bad), "--json")
    assert code == 1 and [r["class"] for r in json.loads(out)] == ["xs", "error: not_an_image"]


def test_batch_commands(pool, capsys, tmp_path: Path) -> None:
    flags, client = pool
    (tmp_path / "img.png").write_bytes(png())
    part = [{"type": "text", "text": "How many?"}, {"type": "image_url", "image_url": {"url": "img.png"}}]
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                        "body": {"model": "tiny-shapes", "max_tokens": 3,
                                                 "messages": [{"role": "user", "content": part}]}}) + "\n"
                            for i in range(3)))
    code, out, _ = run(capsys, "batch", "submit", str(path), *flags)
    batch_id = out.strip()
    assert code == 0 and batch_id.startswith("batch_")
    code, out, _ = run(capsys, "batch", "status", batch_id, *flags)
    assert code == 0 and f"batch {batch_id}: in_progress" in out and "3 total, 0 completed, 0 failed" in out
    code, out, _ = run(capsys, "batch", "cancel", batch_id, *flags)
    assert code == 0 and "cancelled" in out
    code, out, err = run(capsys, "batch", "wait", batch_id, *flags)
    assert code == 1 and "3 failed (3 cancelled)" in out  # a batch with failed requests exits non-zero
    code, out, _ = run(capsys, "batch", "download", batch_id, "--output-dir", str(tmp_path / "dl"), *flags)
    errors = (tmp_path / "dl" / f"{batch_id}_errors.jsonl").read_text().splitlines()
    assert code == 0 and [json.loads(x)["custom_id"] for x in errors] == ["r0", "r1", "r2"]
    mixed = tmp_path / "mixed.jsonl"  # issue 29 item 5: a bad line is refused alone, and said so
    mixed.write_text(path.read_text() + '{"custom_id": "x"}\n')
    code, out, err = run(capsys, "batch", "submit", str(mixed), *flags)
    assert code == 0 and out.strip().startswith("batch_") and "1 of 4 line(s) refused" in err
    assert "line 4: bad_method" in err
    code, out, _ = run(capsys, "batch", "status", out.strip(), *flags)
    assert "4 total, 0 completed, 1 failed; 1 line(s) refused at submit" in out
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"custom_id": "x"}\n')
    code, _, err = run(capsys, "batch", "submit", str(bad), *flags)
    assert code == 1 and "line 1: bad_method" in err
    outside = tmp_path / "sub" / "outside.jsonl"  # issue 36 item 7: ../img.png leads out of the file's folder
    outside.parent.mkdir()
    outside.write_text(path.read_text().replace('"img.png"', '"../img.png"'))
    code, _, err = run(capsys, "batch", "submit", str(outside), *flags)
    assert code == 1 and "line 1: image_outside_folder" in err and "--allow-outside-paths" in err
    code, out, _ = run(capsys, "batch", "submit", str(outside), "--allow-outside-paths", *flags)
    assert code == 0 and out.strip().startswith("batch_")
    bad.write_text('{"custom_id": "x", "body": ' + "[" * 100_000 + "]" * 100_000 + "}\n")  # issue 36 item 6
    code, _, err = run(capsys, "batch", "submit", str(bad), *flags)
    assert code == 1 and "line 1: bad_json" in err and "nested deeper than 32 levels" in err
