"""A real worker's /metrics move as its jobs move, its probes answer, Flower lists its tasks (task events on), and
its JSON log lines name each job's id, model, class, worker and phase (--log-format json)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import inputs
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_pool import png
from workerproc import TINY_CLASSES, WorkerProcess

from vlmq.client import Client
from vlmq.embedded import free_port, wait_for_port
from vlmq.errors import JobFailed
from vlmq.settings import Settings

METRICS_LIST = Path(__file__).resolve().parents[2] / "infra" / "metrics.txt"  # the contract with the dashboard

pytestmark = pytest.mark.slow
PROMPT = "Describe the image."
T = TypeVar("T")


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def scrape(base: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    status, text = get(f"{base}/metrics")
    assert status == 200, text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels``."""
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls)


def wait_for(check: Callable[[], T | None], timeout: float, what: str) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (found := check()) is not None:
            return found
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def flower(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    import redis

    redis.Redis.from_url(redis_url).flushdb()
    port = free_port()
    log = tmp_path_factory.mktemp("flower") / "flower.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "celery", "--broker", redis_url, "flower",
                                 "--address=127.0.0.1", f"--port={port}"], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "FLOWER_UNAUTHENTICATED_API": "true"}, start_new_session=True)
    try:
        wait_for_port(port, timeout=60, proc=proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(20)


@pytest.fixture(scope="module")
def worker(redis_url: str, flower: str,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Settings, str, WorkerProcess]]:
    folder = tmp_path_factory.mktemp("metrics")
    settings = Settings(broker_url=redis_url, storage_url=f"file://{folder / 'storage'}", cost_classes=TINY_CLASSES,
                        worker_batch=2, metrics_port=free_port(), worker_events=True)
    proc = WorkerProcess(settings, Path(folder / "worker.log"), "--log-format", "json")
    try:
        proc.wait_ready()
        yield settings, f"http://127.0.0.1:{settings.metrics_port}", proc
    finally:
        proc.stop()


def test_metrics_move_as_jobs_move(worker: tuple[Settings, str, WorkerProcess]) -> None:
    settings, url, _ = worker
    assert get(f"{url}/healthz") == (200, "ok\n") and get(f"{url}/readyz") == (200, "ok\n")
    assert get(f"{url}/nothing-here")[0] == 404
    before = scrape(url)
    with Client(settings=settings) as client:
        jobs = [client.submit(png(160, 120, i), PROMPT, max_new_tokens=32, ignore_eos=True) for i in range(6)]
        bad = client.submit(inputs.corrupt_png_data(), PROMPT)  # passes the SDK's header probe, fails on the worker
        info = jobs[0].info()
        model, cost_class = info["model"], info["cost_class"]
        q = {"model": model, "class": cost_class}

        def busy() -> dict[Any, float] | None:  # two held, the rest waiting, the oldest some time old
            s = scrape(url)
            ok = (value(s, "vlmq_queue_depth", **q) >= 1 and value(s, "vlmq_queue_unacked", **q) >= 1
                  and value(s, "vlmq_jobs_running") >= 1 and value(s, "vlmq_queue_oldest_age_seconds", **q) > 0)
            return s if ok else None

        during = wait_for(busy, 60, "a scrape with jobs waiting and held")
        assert value(during, "vlmq_batch_cost_tokens", model=model) > 0
        for job in jobs:
            assert len(job.result(timeout=180).token_ids) == 32
        with pytest.raises(JobFailed):
            bad.result(timeout=60)

    def settled() -> dict[Any, float] | None:  # a job's record is final just before its message is acked
        s = scrape(url)
        return s if value(s, "vlmq_queue_unacked", **q) == 0 and value(s, "vlmq_jobs_running", model=model) == 0 \
            else None

    after = wait_for(settled, 30, "the last messages acked")

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("vlmq_jobs_total", status="finished", **q) == 6
    assert moved("vlmq_jobs_total", status="failed", error_type="corrupt_image") == 1
    assert moved("vlmq_job_latency_seconds_count", **q) == 6
    assert moved("vlmq_time_to_first_token_seconds_count", **q) == 6
    assert moved("vlmq_time_to_first_token_seconds_sum", **q) < moved("vlmq_job_latency_seconds_sum", **q)
    assert moved("vlmq_generated_tokens_total", **q) == 6 * 32
    assert moved("vlmq_prompt_tokens_total", **q) > 6 * int(info["vision_tokens"])
    assert moved("vlmq_cache_lookups_total", model=model, cache="encoder") >= 6  # one per image
    assert moved("vlmq_cache_lookups_total", model=model, cache="prefix") >= moved("vlmq_prompt_tokens_total", **q)
    assert moved("vlmq_engine_steps_total", model=model) >= 32
    assert value(after, "vlmq_queue_depth", **q) == 0 and value(after, "vlmq_queue_unacked", **q) == 0
    assert value(after, "vlmq_jobs_running", model=model) == 0
    assert value(after, "vlmq_batch_budget_tokens", model=model) == settings.worker_budget
    assert value(after, "vlmq_worker_info", model=model, device="cpu") == 1


def test_the_worker_exports_exactly_the_listed_series_with_their_labels(worker) -> None:
    settings, url, _ = worker
    with Client(settings=settings) as client:  # a job gives every labelled series its first sample
        client.submit(png(64, 64, 5), PROMPT, max_new_tokens=4).result(timeout=120)
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as reply:
        families = {f.name: f for f in text_string_to_metric_families(reply.read().decode())}
    listed = {}
    for line in METRICS_LIST.read_text().splitlines():
        if line.startswith("#"):
            continue
        name, kind, labels, meaning = line.split("\t")
        if "absent on CPU" not in meaning and "not exported yet" not in meaning:
            listed[name.removesuffix("_total") if kind == "counter" else name] = (kind, set(labels.split(",")))
    assert {n for n in families if n.startswith("vlmq_")} == set(listed)
    for name, (kind, labels) in listed.items():
        assert families[name].type == kind, name
        assert {frozenset(s.labels) - {"le"} for s in families[name].samples} == {frozenset(labels)}, name


def test_flower_lists_the_workers_tasks(worker: tuple[Settings, str, WorkerProcess], flower: str) -> None:
    settings, _, _ = worker
    with Client(settings=settings) as client:
        job = client.submit(png(64, 64, 99), PROMPT, max_new_tokens=4)
        job.result(timeout=120)

    def listed() -> dict[str, Any] | None:
        status, text = get(f"{flower}/api/tasks")
        tasks = json.loads(text).values() if status == 200 else []
        return next((t for t in tasks if job.id in str(t.get("args")) and t.get("state") == "SUCCESS"), None)

    task = wait_for(listed, 30, f"Flower to list the task of job {job.id}")
    assert task["name"] == "vlmq.run_job" and task["worker"].endswith("@vlmq")


def test_json_logs_name_the_job_model_class_worker_and_phase(worker: tuple[Settings, str, WorkerProcess]) -> None:
    settings, _, proc = worker
    with Client(settings=settings) as client:
        job = client.submit(png(64, 64, 7), PROMPT, max_new_tokens=4)
        job.result(timeout=120)
        info = job.info()

    def job_lines() -> list[str] | None:  # the worker logs "finished" just after the result is visible
        lines = [line for line in proc.log().splitlines() if job.id in line]
        return lines if any('"finished"' in line for line in lines) else None

    docs = [json.loads(line) for line in wait_for(job_lines, 10, "the job's finished log line")]  # one JSON each
    assert {d["job_id"] for d in docs} == {job.id}
    assert {(d["model"], d["class"], d["worker"]) for d in docs} == {(info["model"], info["cost_class"],
                                                                      info["worker"])}
    assert [d["phase"] for d in docs if "phase" in d] == ["started", "finished"]
