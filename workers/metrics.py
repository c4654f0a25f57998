"""One worker process's Prometheus metrics, served with ``/healthz`` and ``/readyz`` on ``VLMQ_METRICS_PORT``.

Job counters and histograms are updated by the job runner as jobs end; everything else (queues, the held
batch, engine counters, GPU memory) is read when Prometheus scrapes. Every name starts with ``vlmq_``; the
docs/operations.md lists them (infra/metrics.txt is the list a test holds the worker to).
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from vlmq.fleet import orphans_resent, queue_stats
from vlmq.workers.native import worker_thread

if TYPE_CHECKING:
    from vlmq.workers.costgate import CostBudget

log = logging.getLogger(__name__)
disable_created_metrics()  # no *_created series: restarts show as counter resets anyway
REGISTRY = CollectorRegistry()
LABELS = ("model", "class")
SECONDS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
STALL_S = 300.0  # the step loop counts as dead when it has not come round for this long

JOBS = Counter("vlmq_jobs", "Jobs this worker ended, by final status and error type", [*LABELS, "status",
               "error_type"], registry=REGISTRY)
JOB_LATENCY = Histogram("vlmq_job_latency_seconds", "From submit to the result (finished jobs)", LABELS,
                        buckets=SECONDS, registry=REGISTRY)
TIME_TO_FIRST_TOKEN = Histogram("vlmq_time_to_first_token_seconds", "From submit to the first generated token "
                                "(finished jobs, engine backend)", LABELS, buckets=SECONDS, registry=REGISTRY)
PROMPT_TOKENS = Counter("vlmq_prompt_tokens", "Prompt tokens (text and image) of finished jobs; rate() is "
                        "tokens/s in", LABELS, registry=REGISTRY)
GENERATED_TOKENS = Counter("vlmq_generated_tokens", "Generated tokens of finished jobs; rate() is tokens/s out",
                           LABELS, registry=REGISTRY)


@dataclass(slots=True)
class Totals:
    """This process's running totals, for its status hash (``vlmq top``)."""

    finished: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0


TOTALS = Totals()
_totals_lock = threading.Lock()


def job_finished(model: str, cost_class: str, latency_s: float, first_token_s: float | None, prompt_tokens: int,
                 generated_tokens: int) -> None:
    JOBS.labels(model, cost_class, "finished", "").inc()
    JOB_LATENCY.labels(model, cost_class).observe(latency_s)
    if first_token_s is not None:
        TIME_TO_FIRST_TOKEN.labels(model, cost_class).observe(first_token_s)
    PROMPT_TOKENS.labels(model, cost_class).inc(prompt_tokens)
    GENERATED_TOKENS.labels(model, cost_class).inc(generated_tokens)
    with _totals_lock:
        TOTALS.finished += 1
        TOTALS.prompt_tokens += prompt_tokens
        TOTALS.generated_tokens += generated_tokens


def job_ended(model: str, cost_class: str, status: str, error_type: str = "") -> None:
    """A job that ended without a result: failed (with its error type) or canceled."""
    JOBS.labels(model, cost_class, status, error_type).inc()
    if status == "failed":
        with _totals_lock:
            TOTALS.failed += 1


# the EngineStats fields exported; they count up from the engine's start (a fresh engine adds on)
ENGINE_COUNTERS = ("num_steps", "num_preemptions", "encoder_cache_hits", "encoder_cache_misses",
                   "prefix_cache_hit_tokens", "prefix_cache_query_tokens")


class EngineCounters:
    """The engine's counters made monotonic across engine restarts (a failed step starts a fresh engine)."""

    def __init__(self) -> None:
        self._engine: Any = None
        self._base = dict.fromkeys(ENGINE_COUNTERS, 0)

    def read(self, engine: Any) -> dict[str, int]:
        if engine is not self._engine:
            if self._engine is not None:  # the old engine's stats are final now
                self._base = {k: v + getattr(self._engine.stats, k) for k, v in self._base.items()}
            self._engine = engine
        return {k: v + getattr(engine.stats, k) for k, v in self._base.items()}


class WorkerCollector(Collector):
    """Figures read at scrape time. ``held_queues`` returns the queue of each message the worker holds."""

    def __init__(self, ctx: Any, budget: CostBudget, pairs: Sequence[tuple[str, str]],
                 held_queues: Callable[[], list[str]]) -> None:
        self.ctx, self.budget, self.pairs = ctx, budget, list(pairs)
        self.held_queues = held_queues
        self.engine_counters = EngineCounters()
        self.model = ctx.model

    def collect(self) -> Iterator[Any]:
        yield from self._queues()
        yield from self._batch()
        yield from self._engine()
        yield from _gpu_memory(self.model, self.ctx.settings.device)
        info = GaugeMetricFamily("vlmq_worker_info", "This worker (value 1)", labels=["worker", "model", "device",
                                                                                       "backend"])
        s = self.ctx.settings
        info.add_metric([self.ctx.name, self.model, s.device, s.backend], 1)
        yield info
        yield _gauge("vlmq_worker_step_loop_age_seconds", "Seconds since the model step loop last came round "
                     "(/healthz fails past 300)", self.model, self.ctx.batcher.loop_age())

    def _queues(self) -> Iterator[Any]:
        depth = GaugeMetricFamily("vlmq_queue_depth", "Jobs waiting in a queue (every priority step)", labels=LABELS)
        unacked = GaugeMetricFamily("vlmq_queue_unacked", "Jobs of a queue delivered to a worker, not acked yet",
                                    labels=LABELS)
        age = GaugeMetricFamily("vlmq_queue_oldest_age_seconds", "Seconds since the oldest waiting or unacked job "
                                "of a queue was queued", labels=LABELS)
        try:
            stats = queue_stats(self.ctx.redis, self.pairs)
        except Exception as e:  # Redis down: /readyz says so; the other figures still come
            log.warning("queue metrics unavailable: %s", e)
            return
        for q in stats:
            depth.add_metric([q.model, q.cost_class], q.waiting)
            unacked.add_metric([q.model, q.cost_class], q.held)
            age.add_metric([q.model, q.cost_class], q.oldest_age_s)
        yield from (depth, unacked, age)
        try:
            resent = orphans_resent(self.ctx.redis)
        except Exception as e:
            log.warning("orphan metrics unavailable: %s", e)
            return
        orphans = CounterMetricFamily("vlmq_orphans_resent", "Lost messages the orphan sweep re-sent from job "
                                      "records, across the fleet (docs/guarantees.md)", labels=["model"])
        orphans.add_metric([self.model], resent)
        yield orphans

    def _batch(self) -> Iterator[Any]:
        held = self.held_queues()
        cost = self.budget.held_cost(held)
        for name, text, value in (("vlmq_jobs_running", "Jobs this worker holds (running or waiting for the model)",
                                   len(held)),
                                  ("vlmq_batch_cost_tokens", "Sum of the class cost bounds of the held jobs", cost),
                                  ("vlmq_batch_budget_tokens", "The worker's cost budget (VLMQ_WORKER_BUDGET)",
                                   self.budget.budget)):
            yield _gauge(name, text, self.model, value)

    def _engine(self) -> Iterator[Any]:
        engine = getattr(self.ctx.batcher.backend, "engine", None)
        if engine is None:  # the hf backend keeps no counters
            return
        c = self.engine_counters.read(engine)
        m = [self.model]
        steps = CounterMetricFamily("vlmq_engine_steps", "Engine steps", labels=["model"])
        steps.add_metric(m, c["num_steps"])
        preempted = CounterMetricFamily("vlmq_preemptions", "Sequences preempted for KV room (recomputed later)",
                                        labels=["model"])
        preempted.add_metric(m, c["num_preemptions"])
        # encoder: images (a hit was encoded for another request); prefix: prompt tokens (a hit reused cached KV)
        lookups = CounterMetricFamily("vlmq_cache_lookups", "Cache lookups: images (encoder), prompt tokens (prefix)",
                                      labels=["model", "cache"])
        hits = CounterMetricFamily("vlmq_cache_hits", "Lookups that hit", labels=["model", "cache"])
        lookups.add_metric([*m, "encoder"], c["encoder_cache_hits"] + c["encoder_cache_misses"])
        hits.add_metric([*m, "encoder"], c["encoder_cache_hits"])
        lookups.add_metric([*m, "prefix"], c["prefix_cache_query_tokens"])
        hits.add_metric([*m, "prefix"], c["prefix_cache_hit_tokens"])
        yield from (steps, preempted, lookups, hits)


def _gauge(name: str, text: str, model: str, value: float) -> GaugeMetricFamily:
    gauge = GaugeMetricFamily(name, text, labels=["model"])
    gauge.add_metric([model], value)
    return gauge


def _gpu_memory(model: str, device: str) -> Iterator[Any]:
    if not device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        return
    free, total = torch.cuda.mem_get_info(device)
    for name, text, value in (("allocated", "Bytes held by tensors", torch.cuda.memory_allocated(device)),
                              ("reserved", "Bytes held by torch's caching allocator",
                               torch.cuda.memory_reserved(device)),
                              ("used", "Bytes in use on the device (every process)", total - free),
                              ("total", "Bytes of device memory", total)):
        gauge = GaugeMetricFamily(f"vlmq_gpu_memory_{name}_bytes", text, labels=["model", "device"])
        gauge.add_metric([model, device], value)
        yield gauge


class Health:
    """``/healthz``: the model step loop is alive; ``/readyz``: the consumer runs and the broker answers."""

    def __init__(self, batcher: Any, redis: Any) -> None:
        self.batcher, self.redis = batcher, redis
        self.consuming = False  # set by Celery's worker_ready, cleared when it shuts down

    def live(self) -> tuple[bool, str]:
        age = self.batcher.loop_age()
        if age > STALL_S:
            return False, f"the model step loop has not come round for {age:.0f} s"
        return True, "ok"

    def ready(self) -> tuple[bool, str]:
        if not self.consuming:
            return False, "not consuming (starting or shutting down)"
        try:
            self.redis.ping()
        except Exception as e:
            return False, f"broker unreachable: {e}"
        return True, "ok"

    def follow_celery(self) -> None:
        from celery.signals import worker_ready, worker_shutting_down

        worker_ready.connect(lambda **_: setattr(self, "consuming", True), weak=False)
        worker_shutting_down.connect(lambda **_: setattr(self, "consuming", False), weak=False)


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, *args: Any) -> None:  # one line per scrape would drown the worker's log
        pass


def app(health: Health) -> Callable[..., Any]:
    metrics = make_wsgi_app(REGISTRY)

    def route(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return metrics(environ, start_response)  # type: ignore[no-any-return]
        if path in ("/healthz", "/readyz"):
            ok, why = health.live() if path == "/healthz" else health.ready()
            start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "text/plain")])
            return [f"{why}\n".encode()]
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"/metrics, /healthz or /readyz\n"]

    return route


def serve(port: int, collector: WorkerCollector, health: Health) -> WSGIServer:
    """Serve /metrics, /healthz and /readyz on every interface (a probe reaches the pod's address)."""
    REGISTRY.register(collector)
    health.follow_celery()
    server = make_server("", port, app(health), server_class=_Server, handler_class=_QuietHandler)
    worker_thread(server.serve_forever, "vlmq-metrics").start()
    log.info("metrics on :%d/metrics (health: /healthz, /readyz)", port)
    return server


def totals() -> dict[str, int]:
    with _totals_lock:
        return {f.name: getattr(TOTALS, f.name) for f in fields(TOTALS)}
