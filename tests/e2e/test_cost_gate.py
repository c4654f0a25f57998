"""A worker holds only what fits its budget; the rest stays in Redis for other workers."""
from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path

import pytest
from test_pool import png
from workerproc import TINY_CLASSES, WorkerProcess

from vlmq import keys
from vlmq.client import Client
from vlmq.jobs import JobStatus
from vlmq.models import resolve_model
from vlmq.settings import Settings
from vlmq.workers import broker
from vlmq.workers.costgate import CostBudget, explain_class_cost

COSTS = {"q.xs": 2304, "q.s": 3072, "q.m": 6144}


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_worker_reserves_only_within_its_budget(redis_url: str, s3_server, tmp_path: Path) -> None:
    import redis

    r = redis.Redis.from_url(redis_url)
    r.flushdb()
    r.script_flush()  # below: the worker popped with vlmq's atomic pop script, not kombu's BRPOP
    # with 128 text tokens a job, xs costs 64 + 128 = 192 tokens and m 1024 + 128: a 384 budget holds two xs jobs
    # and never the m job (a 1000 x 1000 image, 324 vision tokens)
    settings = Settings(broker_url=redis_url, storage_url="s3://vlmq-test/e2e-gate", s3_endpoint_url=s3_server.url,
                        cost_classes=TINY_CLASSES, text_token_bound=128, worker_budget=384)
    with Client(settings=settings) as client:
        # max_new_tokens 32 as the small ones: the default 128 would pass the 128-token text bound, refused at submit
        big = client.submit(png(1000, 1000, 1), "Describe the image.", max_new_tokens=32)
        small = [client.submit(png(200, 150, i), "Describe the image.", max_new_tokens=32) for i in range(12)]
        held: list[int] = []
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                held.append(r.hlen(keys.UNACKED))
                time.sleep(0.005)

        watcher = threading.Thread(target=watch)
        worker = WorkerProcess(settings, tmp_path / "worker.log")
        watcher.start()
        try:
            worker.wait_ready()
            for job in small:
                job.result(timeout=600)
        finally:
            done.set()
            watcher.join()
            worker.stop()
        assert max(held) == 2, f"held at most {max(held)} messages; the budget allows 2"
        assert big.status() is JobStatus.QUEUED
        assert client.queue_depth("tiny-shapes", "m") == 1, "the m job must stay in Redis, visible to other workers"
        assert client.queue_depth("tiny-shapes", "xs") == 0
        assert r.script_exists(hashlib.sha1(broker.POP_SCRIPT.encode()).hexdigest()) == [True]
        # the start-up log says what each consumed class costs and why
        assert "class s costs 384 tokens = 256 vision (the class bound) + 128 text" in worker.log()
        assert "class m costs" not in worker.log()


def test_fitting_queues_shrink_as_messages_are_held() -> None:
    budget = CostBudget(COSTS, budget=8000, max_jobs=16)
    assert budget.fitting([]) == {"q.xs", "q.s", "q.m"}
    assert budget.fitting(["q.xs"]) == {"q.xs", "q.s"}  # 5696 left
    assert budget.fitting(["q.xs", "q.s"]) == {"q.xs"}  # 2624 left
    assert budget.fitting(["q.xs", "q.xs", "q.xs"]) == set()  # 1088 left
    assert budget.fitting(["q.m"]) == set()  # 1856 left


def test_job_count_limit_and_unknown_queues() -> None:
    budget = CostBudget(COSTS, budget=100_000, max_jobs=2)
    assert budget.fitting(["q.xs", "other"]) == set()
    assert budget.held_cost(["q.xs", "other"]) == 2304


def test_a_queue_that_can_never_fit_is_refused_up_front() -> None:
    with pytest.raises(ValueError, match="q.m"):
        CostBudget(COSTS, budget=5000, max_jobs=4)


def test_class_costs_read_as_costs_with_their_reason() -> None:
    settings = Settings()  # default classes: xs=256, s=1024, ..., xl unbounded; text bound 2048
    spec = resolve_model("tiny-shapes", settings)
    assert explain_class_cost(spec, "xl", settings) == (
        "class xl costs 2382 tokens = 334 vision (the largest image tiny-shapes accepts; the class has no upper "
        "bound) + 2048 text (VLMQ_TEXT_TOKEN_BOUND)")
    assert explain_class_cost(spec, "s", settings).startswith(
        "class s costs 3072 tokens = 1024 vision (the class bound; no tiny-shapes image exceeds 334)")
