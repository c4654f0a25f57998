"""The worker's batcher, driven directly with in-memory backends (no queue, no model): jobs join a streaming
backend between steps, best priority first; one job's failure stays in its slot; a broken backend fails the
jobs it held and the batcher carries on; shutdown hands every waiting and running job back."""
from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

from vlmq.errors import HandBack
from vlmq.workers.backends.base import Backend, GenOutput, GenRequest, StreamingBackend
from vlmq.workers.batcher import Batcher
from vlmq.workers.engine.sequence import FinishReason

pytestmark = pytest.mark.timeout(60)
WAIT = 30.0  # seconds any single wait below may take before the test fails


def request(job_id: str, tokens: int = 2, priority: int = 5, prompt: str = "ok") -> GenRequest:
    return GenRequest(job_id, None, prompt, tokens, priority=priority)


class CountingBackend(StreamingBackend):
    """Every started request finishes after max_new_tokens steps. With `gated`, each step waits for a permit
    (`allow(n)`), so a test decides when the running batch moves; prompt "bad" cannot start, "crash" breaks a step."""

    def __init__(self, gated: bool = False) -> None:
        self.model_dir = "memory"
        self.live: dict[str, tuple[GenRequest, list[int]]] = {}
        self.started: list[str] = []
        self._gate = threading.Semaphore(0) if gated else None
        self._cond = threading.Condition()

    def allow(self, steps: int) -> None:
        assert self._gate is not None
        self._gate.release(steps)

    def wait_started(self, count: int) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.started) >= count, timeout=WAIT), self.started

    def start(self, request: GenRequest) -> str:
        if request.prompt == "bad":
            raise ValueError(f"{request.job_id} cannot start")
        with self._cond:
            self.started.append(request.job_id)
            self._cond.notify_all()
        self.live[request.job_id] = (request, [])
        return request.job_id

    def step(self) -> list[tuple[str, GenOutput | Exception]]:
        if self._gate is not None:
            assert self._gate.acquire(timeout=WAIT), "the test never allowed this step"
        if any(r.prompt == "crash" for r, _ in self.live.values()):
            self.live.clear()
            raise RuntimeError("the backend broke")
        done = []
        for handle, (req, tokens) in list(self.live.items()):
            tokens.append(len(tokens))
            if len(tokens) == req.max_new_tokens:
                del self.live[handle]
                done.append((handle, GenOutput(req.job_id, tokens, FinishReason.LENGTH, 1, 0)))
        return done


class BatchBackend(Backend):
    """A whole-batch backend: prompt "bad" fails in its slot, "crash" breaks the batch it is in."""

    def __init__(self) -> None:
        self.model_dir = "memory"
        self.batches: list[list[str]] = []

    def generate(self, requests: list[GenRequest]) -> list[GenOutput | Exception]:
        self.batches.append([r.job_id for r in requests])
        if any(r.prompt == "crash" for r in requests):
            raise RuntimeError("the backend broke")
        return [ValueError(f"{r.job_id} is bad") if r.prompt == "bad"
                else GenOutput(r.job_id, [0] * r.max_new_tokens, FinishReason.LENGTH, 1, 0) for r in requests]


def result(future: Future[GenOutput]) -> GenOutput:
    return future.result(timeout=WAIT)


def test_a_job_joins_the_running_batch_and_leaves_before_it() -> None:
    backend = CountingBackend(gated=True)
    batcher = Batcher(backend, max_batch=4, linger_s=0)
    try:
        long = batcher.submit(request("long", tokens=6))
        backend.wait_started(1)
        short = batcher.submit(request("short", tokens=1))
        backend.allow(2)  # the long job's first step may already be waiting for this permit
        assert result(short).text == "short" and not long.done()
        backend.allow(10)
        assert result(long).token_ids == list(range(6))
    finally:
        batcher.hand_back_all("test over")


def test_waiting_jobs_join_best_priority_first() -> None:
    backend = CountingBackend(gated=True)
    batcher = Batcher(backend, max_batch=1, linger_s=0)  # room for one job at a time: the rest wait
    try:
        first = batcher.submit(request("first", priority=5))
        backend.wait_started(1)
        futures = [batcher.submit(request(job_id, priority=p)) for job_id, p in
                   (("low", 9), ("normal", 5), ("high", 0), ("normal-2", 5))]
        backend.allow(100)
        for future in [first, *futures]:
            result(future)
        assert backend.started == ["first", "high", "normal", "normal-2", "low"]  # FIFO within a priority
    finally:
        batcher.hand_back_all("test over")


def test_a_job_that_cannot_start_fails_alone() -> None:
    backend = CountingBackend()
    batcher = Batcher(backend, max_batch=4, linger_s=0.05)
    try:
        bad, good = batcher.submit(request("bad", prompt="bad")), batcher.submit(request("good"))
        with pytest.raises(ValueError, match="bad cannot start"):
            result(bad)
        assert result(good).token_ids == [0, 1]
    finally:
        batcher.hand_back_all("test over")


def test_a_broken_step_fails_the_running_jobs_and_the_batcher_goes_on() -> None:
    backend = CountingBackend(gated=True)
    batcher = Batcher(backend, max_batch=4, linger_s=0)
    try:
        crash = batcher.submit(request("crash", tokens=5, prompt="crash"))
        backend.wait_started(1)
        backend.allow(1)
        with pytest.raises(RuntimeError, match="the backend broke"):
            result(crash)
        after = batcher.submit(request("after"))
        backend.allow(10)
        assert result(after).token_ids == [0, 1]
    finally:
        batcher.hand_back_all("test over")


def test_whole_batch_backends_fail_a_bad_slot_alone_and_survive_a_broken_batch() -> None:
    backend = BatchBackend()
    batcher = Batcher(backend, max_batch=8, linger_s=0.2)  # jobs submitted together run together
    try:
        bad, good = batcher.submit(request("bad", prompt="bad")), batcher.submit(request("good", tokens=3))
        with pytest.raises(ValueError, match="bad is bad"):
            result(bad)
        assert result(good).token_ids == [0, 0, 0]
        with pytest.raises(RuntimeError, match="broke"):
            result(batcher.submit(request("crash", prompt="crash")))
        assert result(batcher.submit(request("later"))).text == "later"
        assert backend.batches == [["bad", "good"], ["crash"], ["later"]]
    finally:
        batcher.hand_back_all("test over")


def test_shutdown_hands_back_running_and_waiting_jobs() -> None:
    backend = CountingBackend(gated=True)
    batcher = Batcher(backend, max_batch=1, linger_s=0)
    running = batcher.submit(request("running", tokens=50))
    backend.wait_started(1)
    waiting = batcher.submit(request("waiting"))
    assert batcher.hand_back_all("worker shutting down") == 2
    for future in (running, waiting):
        with pytest.raises(HandBack, match="worker shutting down"):
            result(future)
    with pytest.raises(RuntimeError, match="batcher stopped"):
        batcher.submit(request("late"))
    backend.allow(1)  # let the model thread see the stop and exit
