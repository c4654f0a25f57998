"""Webhooks end to end: a real delivery worker process, real Valkey, real HTTP receivers on loopback.

The delivery worker allow-lists exactly 127.0.0.1/32 (where the receivers listen); 127.0.0.2 is loopback
too but not allow-listed, so a receiver there proves that the guard refuses (nothing reaches it). The
retry schedule is compressed to 0.4, 0.8 and 1.6 s and the timeout to 1 s.
"""
from __future__ import annotations

import dataclasses
import io
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from PIL import Image
from receiver import Answer, Receiver
from standardwebhooks import Webhook, WebhookVerificationError
from test_jobrunner import EchoBackend, png
from workerproc import TINY_CLASSES, WorkerProcess

from vlmq import keys, webhooks
from vlmq.client import Client
from vlmq.embedded import free_port
from vlmq.errors import InvalidRequest
from vlmq.jobs import JobStatus
from vlmq.settings import Settings
from vlmq.workers.batcher import Batcher
from vlmq.workers.jobrunner import WorkerContext, run_job

pytestmark = pytest.mark.timeout(180)
NEW_SECRET, OLD_SECRET = webhooks.new_secret(), webhooks.new_secret()
SCHEDULE = (0.4, 0.8, 1.6)
TIMEOUT = 1.0
N_JOBS = 8
DB = 5  # its own database: other tests flush database 0, which would drop the delivery worker's queue bindings


@pytest.fixture(scope="module")
def delivery(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    url = f"{redis_url.rsplit('/', 1)[0]}/{DB}"
    redis.Redis.from_url(url).flushdb()
    tmp = tmp_path_factory.mktemp("webhooks")
    settings = Settings(broker_url=url, storage_url=f"file://{tmp}/store", webhook_allow="127.0.0.1/32",
                        webhook_secrets=f"{NEW_SECRET} {OLD_SECRET}",
                        webhook_retry_schedule=",".join(map(str, SCHEDULE)), webhook_timeout=TIMEOUT,
                        webhook_poll=0.05, webhook_inline_max=2000)
    worker = WorkerProcess(settings, tmp / "delivery.log", entry=("-m", "vlmq.delivery"))
    try:
        worker.wait_ready(60)
        yield settings
    finally:
        worker.stop()


@pytest.fixture
def rds(delivery: Settings) -> Iterator[Any]:
    client = redis.Redis.from_url(delivery.broker_url)
    yield client
    client.close()


@pytest.fixture
def receiver() -> Iterator[Callable[..., Receiver]]:
    started: list[Receiver] = []

    def start(*args: Any, **kwargs: Any) -> Receiver:
        started.append(Receiver(*args, **kwargs))
        return started[-1]

    yield start
    for r in started:
        r.stop()


def wait_attempts(rds: Any, subject: str, done: Callable[[list[dict[str, Any]]], bool],
                  timeout: float = 20.0) -> list[dict[str, Any]]:
    """The subject's recorded attempts once ``done`` holds for them (polled; bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        attempts = webhooks.read_deliveries(rds, subject)
        if done(attempts):
            return attempts
        if time.monotonic() > deadline:
            raise TimeoutError(f"attempts for {subject} after {timeout} s: {attempts}")
        time.sleep(0.05)


def settled(attempts: list[dict[str, Any]]) -> bool:
    return bool(attempts) and attempts[-1]["outcome"] != "retry"


def state(rds: Any, event_id: str) -> str:
    return rds.hget(keys.webhook_event(event_id), "state").decode()


def test_a_signed_event_verifies_with_either_active_secret(rds: Any, receiver: Callable[..., Receiver]) -> None:
    r = receiver()
    eid = webhooks.enqueue_event(rds, "batch.completed", {"id": "batch_sig", "status": "completed"}, r.url)
    got = r.wait_for(1)[0]
    assert got.headers["webhook-id"] == eid and got.headers["content-type"] == "application/json"
    assert len(got.headers["webhook-signature"].split(" ")) == 2  # one v1 signature per active secret (rotation)
    for secret in (NEW_SECRET, OLD_SECRET):
        event = Webhook(secret).verify(got.body, got.headers)
        assert event["type"] == "batch.completed" and event["data"] == {"id": "batch_sig", "status": "completed"}
    with pytest.raises(WebhookVerificationError):
        Webhook(webhooks.new_secret()).verify(got.body, got.headers)
    with pytest.raises(WebhookVerificationError):
        Webhook(NEW_SECRET).verify(got.body.replace(b"completed", b"failed"), got.headers)
    attempts = wait_attempts(rds, "batch_sig", settled)
    assert [(a["outcome"], a["status_code"], a["event_id"]) for a in attempts] == [("delivered", 200, eid)]
    # queuing the same event again (a redelivered job) neither re-sends nor re-schedules it
    assert webhooks.enqueue_event(rds, "batch.completed", {"id": "batch_sig"}, r.url) == eid
    assert state(rds, eid) == "delivered" and rds.zscore(keys.webhook_due(), eid) is None


def test_500s_and_a_timeout_are_retried_on_the_schedule(rds: Any, receiver: Callable[..., Receiver]) -> None:
    r = receiver(script=[Answer(500), Answer(503), Answer(200, sleep=TIMEOUT + 0.6)])
    eid = webhooks.enqueue_event(rds, "batch.completed", {"id": "batch_retry"}, r.url)
    got = r.wait_for(4, timeout=30)
    assert {g.headers["webhook-id"] for g in got} == {eid}  # one id across attempts: receivers deduplicate on it
    for g in got:  # each attempt is signed afresh, with its own timestamp
        Webhook(OLD_SECRET).verify(g.body, g.headers)
    for i, delay in enumerate(SCHEDULE):
        gap = got[i + 1].at - got[i].at - (TIMEOUT if i == 2 else 0.0)
        assert delay * 0.8 - 0.05 <= gap <= delay * 1.2 + 1.5, (i, gap)
    attempts = wait_attempts(rds, "batch_retry", settled)
    assert [a["outcome"] for a in attempts] == ["retry", "retry", "retry", "delivered"]
    assert [a["status_code"] for a in attempts] == [500, 503, None, 200]
    assert "TimeoutError" in attempts[2]["error"] and attempts[2]["duration_s"] < TIMEOUT + 0.5
    assert all(a["next_at"] > a["at"] for a in attempts[:3])


def test_410_disables_the_endpoint(rds: Any, receiver: Callable[..., Receiver]) -> None:
    r = receiver(default=Answer(410))
    first = webhooks.enqueue_event(rds, "batch.completed", {"id": "batch_gone1"}, r.url)
    assert [a["outcome"] for a in wait_attempts(rds, "batch_gone1", settled)] == ["disabled"]
    assert state(rds, first) == "disabled"
    webhooks.enqueue_event(rds, "batch.completed", {"id": "batch_gone2"}, r.url)
    later = wait_attempts(rds, "batch_gone2", settled)
    assert [(a["outcome"], a["status_code"]) for a in later] == [("disabled", None)]
    assert "410" in later[0]["error"] and len(r.requests) == 1  # the second event never reached the endpoint
    r.default = Answer(200)  # the endpoint is back, and its owner enables it again
    assert webhooks.enable_endpoint(rds, r.url)
    webhooks.enqueue_event(rds, "batch.completed", {"id": "batch_gone3"}, r.url)
    assert [a["outcome"] for a in wait_attempts(rds, "batch_gone3", settled)] == ["delivered"]


def test_a_receiver_down_for_a_while_gets_every_event(rds: Any, receiver: Callable[..., Receiver]) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/hook"
    subjects = [f"batch_down{i}" for i in range(5)]
    ids = {webhooks.enqueue_event(rds, "batch.completed", {"id": s}, url) for s in subjects}
    for s in subjects:  # every event failed against the closed port at least once ...
        failed = wait_attempts(rds, s, lambda a: bool(a))
        assert failed[0]["outcome"] == "retry" and "Connection" in failed[0]["error"]
    r = receiver(port=port)  # ... and the receiver comes back
    for s in subjects:
        assert wait_attempts(rds, s, settled)[-1]["outcome"] == "delivered"
    assert {g.headers["webhook-id"] for g in r.requests} == ids  # at least once each; dedupe on webhook-id


def test_redirects_are_not_followed(rds: Any, receiver: Callable[..., Receiver]) -> None:
    trap = receiver(host="127.0.0.2")  # loopback, not allow-listed
    targets = {"batch_redir1": trap.url, "batch_redir2": "http://169.254.169.254/latest/meta-data/"}
    for subject, location in targets.items():
        r = receiver(default=Answer(302, headers={"location": location}))
        webhooks.enqueue_event(rds, "batch.completed", {"id": subject}, r.url)
    for subject, location in targets.items():
        attempts = wait_attempts(rds, subject, settled)
        assert [a["outcome"] for a in attempts] == ["retry"] * len(SCHEDULE) + ["failed"]  # 3xx is a failure
        assert all(a["status_code"] == 302 and "not followed" in a["error"] and location in a["error"]
                   for a in attempts)
    assert trap.requests == []


def test_the_guard_refuses_internal_targets_at_delivery(rds: Any, receiver: Callable[..., Receiver]) -> None:
    trap = receiver(host="127.0.0.2")  # a live listener: the refusal is the guard's, not a connection error
    targets = {"batch_guard1": (trap.url, "127.0.0.2 is a loopback address"),
               "batch_guard2": ("http://10.1.2.3/hook", "private"),
               "batch_guard3": ("http://169.254.169.254/latest/meta-data/", "cloud metadata"),
               "batch_guard4": (f"http://[::1]:{trap.port}/hook", "loopback")}
    ids = {s: webhooks.enqueue_event(rds, "batch.completed", {"id": s}, url) for s, (url, _) in targets.items()}
    for subject, (_, why) in targets.items():
        attempts = wait_attempts(rds, subject, settled)
        assert [a["outcome"] for a in attempts] == ["refused"] and why in attempts[0]["error"]
        assert state(rds, ids[subject]) == "failed"  # not retried
    assert trap.requests == []


def test_a_forged_event_is_dropped_and_delivery_carries_on(rds: Any, receiver: Callable[..., Receiver]) -> None:
    forged = "evt_" + "f" * 32
    rds.hset(keys.webhook_event(forged), mapping={"type": "job.pwned", "url": "http://127.0.0.1:9/", "subject": "x",
                                                  "attempts": "0", "state": "pending", "created_at": "0"})
    rds.zadd(keys.webhook_due(), {forged: 0})
    r = receiver()
    webhooks.enqueue_event(rds, "batch.completed", {"id": "batch_after_forged"}, r.url)
    assert wait_attempts(rds, "batch_after_forged", settled)[-1]["outcome"] == "delivered"
    assert state(rds, forged) == "failed" and rds.zscore(keys.webhook_due(), forged) is None


@pytest.fixture
def gpu(delivery: Settings) -> Iterator[WorkerContext]:
    """The GPU worker's job adapter in this process, with an echo backend instead of a model."""
    with Client(settings=delivery) as client:
        yield WorkerContext(delivery, client.redis, client.storage, Batcher(EchoBackend(), 4), "tiny-shapes",
                            "unit")


def test_job_events_carry_result_or_error_and_are_recorded_on_the_job(
        delivery: Settings, gpu: WorkerContext, receiver: Callable[..., Receiver]) -> None:
    r = receiver()
    with Client(settings=delivery, webhook=r.url) as client:  # the client-level default webhook
        jobs = {"small": client.submit(png(), "small", max_new_tokens=3),
                "large": client.submit(png(), "large", max_new_tokens=600),  # result > VLMQ_WEBHOOK_INLINE_MAX
                "crash": client.submit(png(), "crash", max_new_tokens=3),
                "cancel": client.submit(png(), "cancel", max_new_tokens=3),
                "none": client.submit(png(), "none", max_new_tokens=3, webhook="")}
        jobs["cancel"].cancel()
        for job in jobs.values():
            run_job(gpu, job.id)
        events = {json.loads(g.body)["data"]["id"]: json.loads(g.body) for g in r.wait_for(4)}
        assert set(events) == {jobs[k].id for k in ("small", "large", "crash", "cancel")}
        small, large = events[jobs["small"].id], events[jobs["large"].id]
        assert small["type"] == "job.finished" and small["data"]["status"] == "finished"
        assert small["data"]["result"] == jobs["small"].result().raw and small["data"]["error"] is None
        assert large["data"]["result"] is None and large["data"]["result_key"] == keys.result_object(jobs["large"].id)
        assert client.storage.exists(large["data"]["result_key"])
        crash = events[jobs["crash"].id]
        assert crash["type"] == "job.failed" and crash["data"]["error"]["type"] == "model_error"
        assert events[jobs["cancel"].id]["type"] == "job.canceled"
        for name in ("small", "large", "crash", "cancel"):
            attempts = wait_attempts(client.redis, jobs[name].id, settled)
            assert [a["outcome"] for a in jobs[name].deliveries()] == ["delivered"], attempts
        assert jobs["none"].status() is JobStatus.FINISHED and jobs["none"].deliveries() == []
        # a redelivered message finds the job ended: the event is not queued twice
        run_job(gpu, jobs["small"].id)
        assert client.redis.zscore(keys.webhook_due(), webhooks.event_id("job.finished", jobs["small"].id)) is None


def test_submit_refuses_internal_webhooks_before_enqueuing(delivery: Settings, tmp_path: Path) -> None:
    plain = Settings(broker_url=delivery.broker_url, storage_url=f"file://{tmp_path}")  # no allow-list
    with Client(settings=plain) as client:
        depth = client.queue_depth("tiny-shapes", "xs")
        for url in ("http://127.0.0.1:8080/hook", "http://10.0.0.1/", "http://169.254.169.254/", "http://[::1]/",
                    "ftp://example.com/"):
            with pytest.raises(InvalidRequest) as info:
                client.submit(png(), "hello", webhook=url)
            assert info.value.code == "bad_webhook"
        with Client(settings=plain, webhook="http://localhost:9/") as defaulted, \
                pytest.raises(InvalidRequest, match="loopback"):
            defaulted.submit(png(), "hello")
        assert client.queue_depth("tiny-shapes", "xs") == depth  # nothing was enqueued


def solid(i: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (64, 48), (i * 37 % 256, i * 91 % 256, 200)).save(buf, "PNG")
    return buf.getvalue()


@pytest.mark.slow
def test_a_slow_receiver_leaves_job_throughput_unchanged(redis_url: str, tmp_path: Path,
                                                        receiver: Callable[..., Receiver]) -> None:
    """One real worker process; the same jobs without webhooks, then with a receiver that sleeps 10 s each."""
    url = f"{redis_url.rsplit('/', 1)[0]}/{DB + 1}"
    redis.Redis.from_url(url).flushdb()
    settings = Settings(broker_url=url, storage_url=f"file://{tmp_path}/store", cost_classes=TINY_CLASSES,
                        webhook_allow="127.0.0.1/32", webhook_secrets=NEW_SECRET, webhook_timeout=15.0,
                        webhook_poll=0.05)
    slow = receiver(default=Answer(200, sleep=10.0))
    gpu_worker = WorkerProcess(settings, tmp_path / "worker.log", "--name", "throughput")
    sender = WorkerProcess(settings, tmp_path / "delivery.log", entry=("-m", "vlmq.delivery"))
    try:
        gpu_worker.wait_ready()
        sender.wait_ready(60)
        with Client(settings=settings) as client:
            client.submit(png(), "warm up", max_new_tokens=8).result(timeout=120)

            def run(webhook: str, seed: int) -> float:  # a new image per job: no cache makes one run faster
                started = time.monotonic()
                jobs = [client.submit(solid(seed + i), f"job {i}", max_new_tokens=240, ignore_eos=True,
                                      webhook=webhook) for i in range(N_JOBS)]
                for job in jobs:
                    job.result(timeout=120)
                return time.monotonic() - started

            plain = run("", 0)
            with_hooks = run(slow.url, N_JOBS)
            all_done = time.monotonic()
            got = slow.wait_for(N_JOBS, timeout=30)  # every event was sent, and is held 10 s by the receiver
        print(f"{N_JOBS} jobs: {plain:.2f} s without webhooks, {with_hooks:.2f} s with a receiver sleeping 10 s")
        # no job waited for its webhook: the last one ended before the receiver could answer the first request
        assert all_done < got[0].at + 10.0
        assert with_hooks <= 2 * plain + 2.0, (plain, with_hooks)  # loose: shared CI cores make timings noisy
        assert len({g.headers["webhook-id"] for g in got}) == N_JOBS
    finally:
        gpu_worker.stop()
        sender.proc.kill()  # its requests are still held by the receiver; nothing to wait for
        sender.proc.wait()


def test_a_large_result_goes_by_presigned_url_on_s3(delivery: Settings, rds: Any, s3_server: Any,
                                                    s3_storage_url: str) -> None:
    import urllib.request

    from vlmq.delivery import DeliveryContext, job_data
    from vlmq.jobs import new_job_id
    from vlmq.storage import open_storage

    settings = dataclasses.replace(delivery, storage_url=s3_storage_url, s3_endpoint_url=s3_server.url)
    storage = open_storage(settings.storage_url, settings.s3_endpoint_url)
    ctx = DeliveryContext(settings, rds, storage, [NEW_SECRET])
    small, large = new_job_id(), new_job_id()
    for job_id, size in ((small, 10), (large, 5000)):
        rds.hset(keys.job(job_id), mapping={"id": job_id, "status": "finished"})
        storage.put(keys.result_object(job_id), json.dumps({"job_id": job_id, "text": "x" * size}).encode())
    assert job_data(ctx, small, "job.finished")["result"]["text"] == "x" * 10
    data = job_data(ctx, large, "job.finished")
    assert data["result"] is None and data["result_key"] == keys.result_object(large)
    with urllib.request.urlopen(data["result_url"], timeout=10) as response:  # no credentials: the URL carries them
        assert json.loads(response.read())["text"] == "x" * 5000
