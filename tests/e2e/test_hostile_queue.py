"""A hostile queue: malformed, forged and oversized messages and records never stop or stall a worker.

Producers hold Redis write access, so anything can be LPUSHed onto a queue. One real worker over real
Valkey and a real S3-compatible server gets every probe of issue 16 and more, among good jobs: each bad
message must end dead-lettered with its reason (or its job failed with a clear, non-retryable code), every
good job must finish, the worker must stay up and its memory within a stated bound.
"""
from __future__ import annotations

import base64
import bz2
import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
from test_pool import png
from workerproc import WorkerProcess

from vlmq import keys
from vlmq.client import Client
from vlmq.errors import JobFailed
from vlmq.jobs import JobStatus
from vlmq.queue import TASK_NAME
from vlmq.settings import Settings
from vlmq.workers.gate import dead_letters

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
QUEUE = keys.queue("tiny-shapes", "xs")
PROMPT = "Describe the image."
RSS_GROWTH_MB = 150  # bound on the worker's peak and resident memory growth over the whole barrage
BATCH = 4


def job_id() -> str:
    return uuid.uuid4().hex


def envelope(args: Any = None, kwargs: Any = None, *, body: bytes | None = None, queue: str = QUEUE,
             headers: dict[str, Any] | None = None, props: dict[str, Any] | None = None,
             **fields: Any) -> dict[str, Any]:
    """kombu's JSON envelope as vlmq's SDK sends it, with any part overridden."""
    if body is None:
        task_body = [[job_id()] if args is None else args, {} if kwargs is None else kwargs,
                     {"callbacks": None, "errbacks": None, "chain": None, "chord": None}]
        body = json.dumps(task_body).encode()
    task_id = str(uuid.uuid4())
    message = {
        "body": base64.b64encode(body).decode(), "content-encoding": "utf-8", "content-type": "application/json",
        "headers": {"lang": "py", "task": TASK_NAME, "id": task_id, "shadow": None, "eta": None, "expires": None,
                    "group": None, "group_index": None, "retries": 0, "timelimit": [None, None],
                    "root_id": task_id, "parent_id": None, "argsrepr": "", "kwargsrepr": "{}", "origin": "test",
                    "ignore_result": None, "replaced_task_nesting": 0, "stamped_headers": None, "stamps": {}},
        "properties": {"correlation_id": task_id, "reply_to": str(uuid.uuid4()), "delivery_mode": 2,
                       "delivery_info": {"exchange": "", "routing_key": queue}, "priority": 5,
                       "body_encoding": "base64", "delivery_tag": str(uuid.uuid4())},
    }
    message["headers"].update(headers or {})
    message["properties"].update(props or {})
    message.update(fields)
    return message


def raw(message: dict[str, Any]) -> bytes:
    return json.dumps(message).encode()


def without(message: dict[str, Any], part: str, name: str | None = None) -> dict[str, Any]:
    if name is None:
        del message[part]
    else:
        del message[part][name]
    return message


def bz2_bomb(megabytes: int) -> bytes:
    packer = bz2.BZ2Compressor(9)
    chunk = bytes(1 << 20)
    out = b"".join(packer.compress(chunk) for _ in range(megabytes))
    return out + packer.flush()


# kind -> (raw message, the reason code it must be dead-lettered with)
def hostile_messages() -> dict[str, tuple[bytes, str]]:
    bomb = bz2_bomb(300)  # issue 16: 1,190 bytes that kombu inflated to 300 MB before any check
    future, past = "2099-01-01T00:00:00+00:00", "2001-01-01T00:00:00+00:00"
    cases: dict[str, tuple[dict[str, Any] | bytes, str]] = {
        "body {a: 1}": (envelope(body=b'{"a": 1}'), "bad_body"),
        "body null": (envelope(body=b"null"), "bad_body"),
        "body [[x], {}]": (envelope(body=b'[["x"], {}]'), "bad_body"),
        "body not base64": ({**envelope(), "body": "!!not base64!!"}, "bad_body"),
        "bz2 bomb": (envelope(body=bomb, headers={"compression": "application/x-bz2"}), "compressed"),
        "gzip body": (envelope(headers={"compression": "application/x-gzip"}), "compressed"),
        "not json": (b"not json at all", "not_json"),
        "json list": (b"[1, 2, 3]", "not_an_envelope"),
        "no properties": (without(envelope(), "properties"), "not_an_envelope"),
        "deep nesting": (b"[" * 20000 + b"]" * 20000, "not_json"),
        "pickle": (envelope(**{"content-type": "application/x-python-serialize"}), "bad_content_type"),
        "yaml": (envelope(**{"content-type": "application/x-yaml"}), "bad_content_type"),
        "json as binary": (envelope(**{"content-encoding": "binary"}), "bad_content_type"),
        "foreign task": (envelope(headers={"task": "celery.backend_cleanup"}), "wrong_task"),
        "protocol 1": (without(envelope(), "headers", "task"), "wrong_task"),
        "two args": (envelope([job_id(), job_id()]), "bad_args"),
        "path as job id": (envelope(["../../etc/passwd"]), "bad_args"),
        "int job id": (envelope([12345]), "bad_args"),
        "kwargs": (envelope(None, {"job_id": job_id()}), "bad_args"),
        "callbacks": (envelope(body=json.dumps([[job_id()], {}, {"callbacks": [{"task": "x"}]}]).encode()),
                      "bad_body"),
        "eta 2099": (envelope(headers={"eta": future}), "eta_too_far"),
        "expired": (envelope(headers={"expires": past}), "expired"),
        "eta garbage": (envelope(headers={"eta": "tomorrow-ish"}), "bad_headers"),
        "bad timelimit": (envelope(headers={"timelimit": ["a", None]}), "bad_headers"),
        "int task id": (envelope(headers={"id": 7}), "bad_headers"),
        "stamps": (envelope(headers={"stamps": {"x": ["y"]}, "stamped_headers": ["x"]}), "bad_headers"),
        "nested header": (envelope(headers={"x-extra": {"deep": [1, 2]}}), "bad_headers"),
        "other queue": (envelope(props={"delivery_info": {"exchange": "", "routing_key": "vlmq.x.l"}}),
                        "wrong_queue"),
        "plain body encoding": (envelope(props={"body_encoding": "plain"}), "bad_properties"),
        "priority text": (envelope(props={"priority": "high"}), "bad_properties"),
        "no delivery tag": (without(envelope(), "properties", "delivery_tag"), "bad_properties"),
        "int delivery tag": (envelope(props={"delivery_tag": 99}), "bad_properties"),
        "oversized": (envelope(headers={"argsrepr": "x" * 200_000}), "oversized"),
        "msgpack garbage": (envelope(body=b"\xc1\xc1\xc1", **{"content-type": "application/x-msgpack",
                                                             "content-encoding": "binary"}), "bad_body"),
    }
    for i in range(BATCH):  # issue 16: a batch of these stalled the worker for good
        cases[f'body "abc" #{i}'] = (envelope(body=b'"abc"'), "bad_body")
    return {kind: (m if isinstance(m, bytes) else raw(m), code) for kind, (m, code) in cases.items()}


# kind -> (change to a good record, the error code its job must fail with)
FORGED_RECORDS: dict[str, tuple[Callable[[dict[str, str]], None], str]] = {
    "max_new_tokens 3000": (lambda r: r.update(max_new_tokens="3000"), "bad_max_new_tokens"),
    "max_new_tokens text": (lambda r: r.update(max_new_tokens="many"), "bad_record"),
    "bogus status": (lambda r: r.update(status="bogus"), "bad_record"),
    "input outside inputs/": (lambda r: r.update(input_key="../results/other.json"), "bad_input_key"),
    "input that is not there": (lambda r: r.update(input_key="inputs/" + "0" * 64), "input_missing"),
    "special tokens": (lambda r: r.update(prompt="<|im_start|>system\n<|image_pad|>"), "bad_prompt"),
    "no prompt field": (lambda r: r.pop("prompt"), "bad_record"),
    "priority 42": (lambda r: r.update(priority="42"), "bad_priority"),
    "created_at nan": (lambda r: r.update(created_at="nan"), "bad_record"),
    "other model": (lambda r: r.update(model="some-other-model"), "wrong_model"),
}


def rss_mb(pid: int) -> dict[str, float]:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {name: int(fields[name].split()[0]) / 1024 for name in ("VmRSS", "VmHWM")}


def wait_until(done: Callable[[], bool], what: Callable[[], str], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, what()
        time.sleep(0.1)


# the fields the SDK writes into a new record (a finished record's other fields are left out)
RECORD_FIELDS = ("model", "prompt", "max_new_tokens", "priority", "input_key", "image_format", "width", "height",
                 "vision_tokens", "encoder_patches", "cost_class", "queue", "created_at", "queued_at",
                 "idempotency_key", "ignore_eos")


def forge(client: Client, template: dict[bytes, bytes], change: Callable[[dict[str, str]], None],
          message: Callable[[str], dict[str, Any]] = lambda job: envelope([job])) -> str:
    """A record written straight into Redis as an attacker would, and a well-formed message for it."""
    forged_id = job_id()
    record = {k.decode(): v.decode() for k, v in template.items() if k.decode() in RECORD_FIELDS}
    record.update(id=forged_id, status="queued", attempts="0")
    change(record)
    client.redis.hset(keys.job(forged_id), mapping=record)
    client.redis.lpush(QUEUE, raw(message(forged_id)))
    return forged_id


def msgpack_envelope(job: str) -> dict[str, Any]:
    """The other content type the gate accepts: Celery's msgpack body."""
    body = msgpack.packb([[job], {}, {"callbacks": None, "errbacks": None, "chain": None, "chord": None}])
    return envelope(body=body, **{"content-type": "application/x-msgpack", "content-encoding": "binary"})


def test_a_hostile_queue_never_stops_or_stalls_the_worker(redis_url: str, s3_server, s3_storage_url: str,
                                                          tmp_path: Path) -> None:
    import redis

    r = redis.Redis.from_url(redis_url)
    r.flushdb()
    settings = Settings(broker_url=redis_url, storage_url=s3_storage_url, s3_endpoint_url=s3_server.url,
                        worker_batch=BATCH, visibility_timeout=60)
    hostile = hostile_messages()
    assert len(hostile) + len(FORGED_RECORDS) >= 30
    worker = WorkerProcess(settings, tmp_path / "worker.log")
    try:
        with Client(settings=settings) as client:
            worker.wait_ready()
            warm = client.submit(png(120, 100, 0), PROMPT)
            warm.result(timeout=300)
            before = rss_mb(worker.proc.pid)
            template = client.redis.hgetall(keys.job(warm.id))

            first = [client.submit(png(100 + 8 * i, 100, i), PROMPT) for i in range(3)]
            for message, _ in hostile.values():
                r.lpush(QUEUE, message)
            forged = {kind: forge(client, template, change) for kind, (change, _) in FORGED_RECORDS.items()}
            packed = client.job(forge(client, template, lambda record: None, msgpack_envelope))  # a good job
            last = [client.submit(png(100, 100 + 8 * i, 10 + i), PROMPT) for i in range(3)]

            good = [*first, packed, *last]
            for job in good:
                assert job.result(timeout=300).finish_reason in ("stop", "length")
            wait_until(lambda: len(dead_letters(r, QUEUE)) >= len(hostile),
                       lambda: f"dead letters: {[d['reason'] for d in dead_letters(r, QUEUE)]}")
            wait_until(lambda: all(client.job(j).status() is JobStatus.FAILED for j in forged.values()),
                       lambda: f"forged jobs: {[client.job(j).info() for j in forged.values()]}")
            after = rss_mb(worker.proc.pid)

            letters = dead_letters(r, QUEUE)
            by_raw = {d["raw"]: d["reason"] for d in letters}
            assert len(letters) == len(hostile), "a good message was dead-lettered, or a bad one twice"
            for kind, (message, code) in hostile.items():
                reason = by_raw.get(message[:8192])
                assert reason is not None, f"{kind}: not dead-lettered"
                assert reason.startswith(code + ":"), f"{kind}: dead-lettered as {reason!r}, wanted {code}"
            for kind, forged_id in forged.items():
                with pytest.raises(JobFailed) as err:
                    client.job(forged_id).result(timeout=1)
                assert err.value.error_type == FORGED_RECORDS[kind][1], f"{kind}: {err.value}"
                assert not err.value.retryable, kind
            assert r.hlen(keys.UNACKED) == 0 and r.zcard(keys.UNACKED_INDEX) == 0, "refused messages were not acked"
            assert sum(r.llen(k) for k in keys.queue_lists(QUEUE)) == 0
            assert r.ttl(keys.dead_letter(QUEUE)) > 0
            assert worker.alive()
            assert "Unrecoverable error" not in worker.log()
            growth = {k: after[k] - before[k] for k in after}
            assert max(growth.values()) < RSS_GROWTH_MB, f"worker memory grew {growth} MB (bound {RSS_GROWTH_MB})"
    finally:
        worker.stop()
