"""What /healthz and /readyz answer, and the engine counters /metrics exports across an engine restart."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import redis
from test_batcher import CountingBackend, request

from vlmq.embedded import free_port
from vlmq.workers import metrics
from vlmq.workers.batcher import Batcher

pytestmark = pytest.mark.timeout(60)


def eventually(check, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_healthz_fails_while_the_step_loop_is_stuck_and_after_it_stopped(monkeypatch) -> None:
    monkeypatch.setattr(metrics, "STALL_S", 0.5)
    backend = CountingBackend(gated=True)
    batcher = Batcher(backend, max_batch=2, linger_s=0)
    health = metrics.Health(batcher, redis=None)
    assert health.live() == (True, "ok")  # idle: the loop comes round every second
    job = batcher.submit(request("a", tokens=1))
    backend.wait_started(1)  # the loop now waits in a step the test has not allowed
    eventually(lambda: not health.live()[0])
    assert "has not come round" in health.live()[1]
    backend.allow(1)
    job.result(timeout=10)
    eventually(lambda: health.live()[0])
    batcher.hand_back_all("shutting down")  # the loop ends: the process is no longer alive
    eventually(lambda: not health.live()[0])


def test_readyz_needs_the_consumer_running_and_the_broker_answering(redis_url: str) -> None:
    health = metrics.Health(batcher=None, redis=redis.Redis.from_url(redis_url))
    assert health.ready() == (False, "not consuming (starting or shutting down)")
    health.consuming = True
    assert health.ready() == (True, "ok")
    health.redis = redis.Redis(port=free_port(), socket_connect_timeout=1)
    ok, why = health.ready()
    assert not ok and why.startswith("broker unreachable")


def test_engine_counters_keep_counting_up_when_the_engine_is_replaced() -> None:
    def engine(steps: int, hits: int) -> SimpleNamespace:
        stats = {field: 0 for field in metrics.ENGINE_COUNTERS}
        stats.update(num_steps=steps, encoder_cache_hits=hits)
        return SimpleNamespace(stats=SimpleNamespace(**stats))

    counters, first = metrics.EngineCounters(), engine(10, 2)
    assert counters.read(first)["num_steps"] == 10
    first.stats.num_steps = 15  # steps after the last scrape, before the engine failed
    fresh = engine(3, 1)
    read = counters.read(fresh)
    assert (read["num_steps"], read["encoder_cache_hits"]) == (18, 3)
