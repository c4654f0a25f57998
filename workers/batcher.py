"""Gathers the jobs a worker holds into batches for its backend.

Celery runs each job in a thread of the worker's pool; each thread hands its
request here and waits. One model thread serves whatever is pending together,
best priority first: a streaming backend (the engine) takes each job as it
arrives, between steps, up to ``max_batch`` at once (its scheduler then orders
them by priority with aging); any other backend gets whole batches.
"""
from __future__ import annotations

import bisect
import logging
import threading
import time
from concurrent.futures import Future

from vlmq.errors import HandBack
from vlmq.workers.backends.base import Backend, GenOutput, GenRequest, StreamingBackend
from vlmq.workers.native import ALL, worker_thread

__all__ = ["Batcher", "HandBack"]  # HandBack lives in vlmq.errors; app and jobrunner import it from here
log = logging.getLogger(__name__)


class Batcher:
    def __init__(self, backend: Backend, max_batch: int, linger_s: float = 0.02) -> None:
        self.backend = backend
        self.max_batch = max_batch
        self.linger_s = linger_s  # a short wait lets jobs reserved together run together
        self._pending: list[tuple[GenRequest, Future[GenOutput]]] = []
        self._inflight: list[Future[GenOutput]] = []
        self._cond = threading.Condition()
        self._stopped = False
        self._beat = time.monotonic()  # when the model loop last came round (waiting counts: it wakes every second)
        loop = self._stream if isinstance(backend, StreamingBackend) else self._loop
        self._thread = worker_thread(loop, "vlmq-model", omp_threads=ALL)  # the only OpenMP team (native.py)
        self._thread.start()

    def submit(self, request: GenRequest) -> Future[GenOutput]:
        future: Future[GenOutput] = Future()
        with self._cond:
            if self._stopped:
                raise RuntimeError("batcher stopped")
            # best priority first (0 is highest), arrival order within a priority
            bisect.insort(self._pending, (request, future), key=lambda item: item[0].priority)
            self._cond.notify()
        return future

    def hand_back_all(self, reason: str) -> int:
        """Stop taking work and fail every waiting or running request with ``HandBack``."""
        with self._cond:
            self._stopped = True
            futures = [f for _, f in self._pending] + self._inflight
            self._pending = []
            self._cond.notify()
        handed = 0
        for future in futures:
            if not future.done():
                future.set_exception(HandBack(reason))
                handed += 1
        return handed

    def loop_age(self) -> float:
        """Seconds since the model loop last came round; infinite once it has stopped."""
        if not self._thread.is_alive():
            return float("inf")
        return time.monotonic() - self._beat

    def _take(self) -> list[tuple[GenRequest, Future[GenOutput]]]:
        with self._cond:
            while not self._pending and not self._stopped:
                self._beat = time.monotonic()
                self._cond.wait(timeout=1.0)
            if self._stopped:
                return []
        time.sleep(self.linger_s)
        with self._cond:
            batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch:]
            self._inflight = [f for _, f in batch]
        return batch

    def _loop(self) -> None:
        while batch := self._take():
            self._beat = time.monotonic()
            requests = [r for r, _ in batch]
            try:
                results = self.backend.generate(requests)
            except Exception as e:  # the backend broke as a whole: every job in the batch sees it
                log.exception("backend failed on a batch of %d", len(batch))
                results = [e] * len(batch)
            for (_, future), result in zip(batch, results, strict=True):
                _resolve(future, result)

    def _stream(self) -> None:
        backend = self.backend
        assert isinstance(backend, StreamingBackend)
        live: dict[str, Future[GenOutput]] = {}
        while True:
            self._beat = time.monotonic()
            with self._cond:
                while not self._pending and not live and not self._stopped:
                    self._beat = time.monotonic()
                    self._cond.wait(timeout=1.0)
                if self._stopped:
                    return
            if not live:  # idle: a short wait lets jobs reserved together start together
                time.sleep(self.linger_s)
            with self._cond:
                room = max(0, self.max_batch - len(live))
                joining, self._pending = self._pending[:room], self._pending[room:]
            for request, future in joining:
                try:
                    live[backend.start(request)] = future
                except Exception as e:
                    log.exception("job %s could not start", request.job_id)
                    _resolve(future, e)
            with self._cond:
                self._inflight = list(live.values())
            try:
                finished = backend.step()
            except Exception as e:  # the backend broke as a whole: every running job sees it
                log.exception("backend step failed with %d jobs running", len(live))
                finished = [(handle, e) for handle in live]
            for handle, result in finished:
                future = live.pop(handle, None)
                if future is not None:
                    _resolve(future, result)


def _resolve(future: Future[GenOutput], result: GenOutput | Exception) -> None:
    if future.done():  # handed back meanwhile
        return
    if isinstance(result, Exception):
        future.set_exception(result)
    else:
        future.set_result(result)
