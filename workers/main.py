"""``vlmq worker``: one Celery worker process per device.

``--device cpu`` (or ``cuda:N``) runs one worker in this process; ``--gpus all``
or ``--gpus 0,1`` starts one child process per GPU, each pinned with
``CUDA_VISIBLE_DEVICES``, and supervises them.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis as redis_lib

from vlmq.models import BUNDLED_MODEL, ModelSpec, class_cost, cost_classes, resolve_model
from vlmq.settings import Settings
from vlmq.storage import open_storage
from vlmq.worker_args import add_worker_arguments

log = logging.getLogger(__name__)
ASSETS = Path(__file__).resolve().parent / "assets"
FUNCTIONS_CHECK_S = 10.0  # seconds between checks that the server still holds the producers' function library


def model_dir(spec: ModelSpec) -> str:
    """Local checkpoint folder of a model (the bundled one lives in the package)."""
    if spec.path:
        return spec.path
    if spec.name == BUNDLED_MODEL:
        return str(ASSETS / BUNDLED_MODEL)
    raise ValueError(f"model {spec.name!r} has no local folder; set VLMQ_MODELS")


def worker_queues(spec: ModelSpec, settings: Settings, classes: str) -> dict[str, int]:
    """Queue name -> class cost for the classes this worker consumes (default: all that fit)."""
    from vlmq import keys

    names = [c.strip() for c in classes.split(",") if c.strip()] or list(cost_classes(settings).names)
    costs = {keys.queue(spec.name, c): class_cost(spec, c, settings) for c in names}
    if not classes.strip():
        costs = {q: c for q, c in costs.items() if c <= settings.worker_budget}
    return costs


def no_cuda_reason() -> str | None:
    """Why no CUDA device can be used here (None when one can): one line for the user."""
    import torch

    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build; install a CUDA build of torch, or use --device cpu"
    if torch.cuda.device_count() == 0:
        return "no CUDA device is visible (check the driver and CUDA_VISIBLE_DEVICES), or use --device cpu"
    return None


def check_device(device: str) -> None:
    """Exit with one clear line when a CUDA device is asked for and none can be used."""
    if device.startswith("cuda") and (reason := no_cuda_reason()):
        raise SystemExit(f"vlmq worker: cannot use device {device!r}: {reason}")


def storage_timeout(settings: Settings) -> float:
    """Seconds one object-store call may wait: a quarter of VLMQ_STORAGE_RETRY (1 to 30 s), so that a frozen store
    fails calls, retried within the retry window, instead of holding a job past it."""
    return min(30.0, max(1.0, settings.storage_retry / 4))


def since_exec() -> float:
    """Seconds since this process was started (exec), from /proc (0 where there is none)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


class StartupClock:
    """Where a worker's start-up goes: seconds since exec at each mark, logged once Celery consumes."""

    def __init__(self) -> None:
        self.marks: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        self.marks[phase] = since_exec()

    def report(self) -> str:
        out, last = [], 0.0
        for phase, at in self.marks.items():
            out.append(f"{phase} {at - last:.2f} s")
            last = at
        return f"start-up: {', '.join(out)} (exec to consuming {last:.2f} s)"


STARTUP = StartupClock()


def default_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def run_worker(settings: Settings, model: str, name: str | None = None) -> int:
    """Load the model and consume this model's queues until stopped.

    Returns:
        The exit status: 0 after a requested stop, non-zero after an unrecoverable error (so a supervisor restarts
        the worker).
    """
    from vlmq import keys
    from vlmq.workers import broker
    from vlmq.workers.app import make_worker_app
    from vlmq.workers.batcher import Batcher
    from vlmq.workers.costgate import CostBudget, explain_class_cost
    from vlmq.workers.fleet import FleetReporter
    from vlmq.workers.jobrunner import WorkerContext
    from vlmq.workers.lease import LeaseRenewer
    from vlmq.workers.native import on_own_thread
    from vlmq.workers.orphans import start_orphan_sweeper
    from vlmq.workers.retention import start_sweeper

    STARTUP.mark("imports")
    broker.check_internals()  # before loading the model: an upgraded kombu/Celery fails here, naming what moved
    broker.use_transient_as_lost()  # BUSY and other "not now" replies: reconnect, never exit
    with _model_load(model):
        spec = resolve_model(model, settings)
    check_device(settings.device)
    shared = worker_queues(spec, settings, settings.worker_classes)
    classes = [c for c in cost_classes(settings).names if keys.queue(spec.name, c) in shared]
    name = name or default_name()
    storage = open_storage(settings.storage_url, settings.s3_endpoint_url, timeout=storage_timeout(settings))
    kv_store = None
    if settings.backend == "engine":
        from vlmq.workers.kvstore import store_from_settings

        kv_store = store_from_settings(settings, spec.name, model_dir(spec), storage)
    with _model_load(model):
        from vlmq.workers.backends import load_backend  # transformers and torch: a broken install fails here

        # on a thread that exits: the model thread must own the only OpenMP team (native.py)
        backend = on_own_thread(lambda: load_backend(
            settings.backend, model_dir(spec), settings.device, kv_tokens=settings.worker_budget, kv_store=kv_store,
            speculative=settings.speculative or "model"))
    STARTUP.mark("model load")
    redis = redis_lib.Redis.from_url(settings.broker_url, socket_connect_timeout=3)
    _load_functions(redis)
    fleet = FleetReporter(redis, settings, spec.name, name, classes, backend.cache_stats)
    # the worker's own queues (affinity routing) cost what the shared queue of their class costs
    own = {keys.worker_queue(spec.name, c, name): shared[keys.queue(spec.name, c)]
           for c in classes} if settings.affinity else {}
    budget = CostBudget({**own, **shared}, settings.worker_budget, settings.worker_batch)
    ctx = WorkerContext(settings, redis, storage, Batcher(backend, settings.worker_batch), spec.name, name, fleet)
    app = make_worker_app(settings, ctx, budget, first=frozenset(own))
    LeaseRenewer(ctx.redis, settings.visibility_timeout).start()
    start_sweeper(settings, ctx.redis, ctx.storage, name)
    start_orphan_sweeper(settings, ctx.redis, name)
    fleet.start(getattr(backend, "archive_model_hash", None))  # set by a backend that archives KV
    log.info("worker %s serving %s on %s with the %s backend, queues %s", name, spec.name, settings.device,
             settings.backend, list(budget.queue_costs))
    for cost_class in classes:
        log.info("cost gate: %s", explain_class_cost(spec, cost_class, settings))
    _start_reporting(ctx, budget, [(spec.name, c) for c in classes])
    # event heartbeats only with task events on (Flower shows the worker online); otherwise no event traffic
    heartbeat = [] if settings.worker_events else ["--without-heartbeat"]
    STARTUP.mark("worker set-up")
    _log_startup_when_consuming()
    return _run_celery(app, ["worker", "--loglevel", "INFO", "--hostname", f"{name}@vlmq", "--without-gossip",
                             "--without-mingle", *heartbeat, "--pool", "threads",
                             "--concurrency", str(settings.worker_batch)])


def _run_celery(app: Any, argv: list[str]) -> int:
    """Run the Celery worker; returns its exit status.

    ``app.worker_main`` and ``app.start`` drop the status (click returns it, Celery does not pass it on), so a worker
    that stopped on an unrecoverable error exited 0 and a supervisor took it for a requested stop. The status is
    read off the worker itself (``worker_init`` sends it).
    """
    from celery.signals import worker_init

    started: list[Any] = []
    worker_init.connect(lambda sender, **_: started.append(sender), weak=False)
    app.worker_main(argv)
    return int(started[-1].exitcode or 0) if started else 1


def _log_startup_when_consuming() -> None:
    from celery.signals import worker_ready

    def ready(**_: object) -> None:
        STARTUP.mark("celery start")
        log.info("%s", STARTUP.report())

    worker_ready.connect(ready, weak=False)


def _load_functions(redis: Any) -> None:
    """Load the producers' function library (``vlmq.functions``), and load it again whenever it is gone.

    A tenant may call it, never load it, so a server that lost it (restarted without persistence, ``FUNCTION
    FLUSH``) would refuse every tenant's submit until some worker loads it again.
    """
    from vlmq import functions
    from vlmq.workers.native import worker_thread

    def check() -> None:
        try:
            if not redis.function_list(library=functions.library()[0]):
                functions.load(redis)
                log.info("loaded the vlmq function library %s", functions.library()[0])
        except redis_lib.RedisError as e:  # Redis down or busy: the next round (or a call that misses it) loads it
            log.warning("could not load the vlmq function library %s: %s", functions.library()[0], e)

    def keep() -> None:
        while True:
            time.sleep(FUNCTIONS_CHECK_S)
            check()

    check()  # before the worker says it is ready: its tenants can submit from then on
    worker_thread(keep, "vlmq-functions").start()


@contextlib.contextmanager
def _model_load(model: str) -> Iterator[None]:
    """A model that cannot be found, read or built ends the process with one line naming the cause (exit 1)."""
    try:
        yield
    except Exception as e:
        log.debug("loading %s failed", model, exc_info=True)
        cause = " ".join(str(e).split()) or "(no message)"
        raise SystemExit(f"vlmq worker: cannot load model {model!r}: {type(e).__name__}: {cause}") from e


def _start_reporting(ctx: Any, budget: Any, pairs: list[tuple[str, str]]) -> None:
    """The status hash ``vlmq top`` reads, and /metrics, /healthz and /readyz when VLMQ_METRICS_PORT is set."""
    from vlmq.workers import broker, metrics
    from vlmq.workers.status import StatusWriter

    def held() -> tuple[int, int]:
        queues = broker.held_queues()
        return len(queues), budget.held_cost(queues)

    s = ctx.settings
    StatusWriter(ctx.redis, ctx.name, {"model": ctx.model, "device": s.device, "budget": str(budget.budget),
                                       "queues": ",".join(budget.queue_costs)}, held).start()
    if s.metrics_port:
        collector = metrics.WorkerCollector(ctx, budget, pairs, broker.held_queues)
        metrics.serve(s.metrics_port, collector, metrics.Health(ctx.batcher, ctx.redis))


def _split(ids: str) -> list[str]:
    return [g.strip() for g in ids.split(",") if g.strip()]


def _gpu_ids(gpus: str, fake: list[str]) -> list[str]:
    if fake:  # VLMQ_FAKE_GPUS: these ids run on the CPU
        ids = fake if gpus == "all" else _split(gpus)
        if unknown := [g for g in ids if g not in fake]:
            raise SystemExit(f"vlmq worker: --gpus names {','.join(unknown)}, not in VLMQ_FAKE_GPUS={','.join(fake)}")
        return ids
    if gpus != "all":  # named ids are checked by each child (and a child that cannot start is given up)
        return _split(gpus)
    check_device("cuda")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return _split(visible)
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def run_gpu_workers(settings: Settings, model: str, gpus: str) -> int:
    """One child worker per GPU; stops them all on SIGTERM/SIGINT, restarts one that dies.

    A child that keeps crashing on start-up is given up and reported (``crashloop``) instead of restarted
    into the same failure forever; when every GPU is given up the supervisor exits with 1.
    """
    from vlmq.workers.crashloop import RestartPolicy

    fake = _split(settings.fake_gpus)
    ids = _gpu_ids(gpus, fake)
    if not ids:
        raise SystemExit("vlmq worker: --gpus named no GPU ids; use --gpus all, --gpus 0,1 or --device cpu")
    children: dict[str, subprocess.Popen[bytes]] = {}
    started: dict[str, float] = {}
    due: dict[str, float] = {}  # GPU -> when its restart is due
    policy = RestartPolicy()
    stopping = False

    def spawn(gpu: str) -> None:
        env = {**os.environ, **settings.to_env(), **_child_env(settings, gpu, ids.index(gpu), bool(fake))}
        children[gpu] = subprocess.Popen([sys.executable, "-m", "vlmq.workers.main", "--model", model], env=env)
        started[gpu] = time.monotonic()
        log.info("started the worker for GPU %s%s: pid %d", gpu, " (on the CPU)" if fake else "", children[gpu].pid)

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True
        for child in children.values():
            child.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    for gpu in ids:
        spawn(gpu)
    while not stopping and (children or due):
        time.sleep(1)
        for gpu, child in list(children.items()):
            if child.poll() is None or stopping:
                continue
            del children[gpu]
            delay = policy.after_exit(gpu, time.monotonic() - started[gpu])
            if delay is None:
                log.error("worker on GPU %s crashed %d times within %.0f s of starting (last exit %s); not "
                          "restarting it: read its log", gpu, policy.crashes[gpu], policy.startup_window_s,
                          child.returncode)
                continue
            log.error("worker on GPU %s exited with %s; restarting in %.0f s", gpu, child.returncode, delay)
            due[gpu] = time.monotonic() + delay
        for gpu, when in list(due.items()):
            if time.monotonic() >= when and not stopping:
                del due[gpu]
                spawn(gpu)
    if not stopping:
        return 1  # every GPU's worker was given up
    return max((c.wait() for c in children.values()), default=0)


def _child_env(settings: Settings, gpu: str, index: int, fake: bool) -> dict[str, str]:
    """What pins a supervised worker to its GPU (or, for a fake GPU, to the CPU), and its own metrics port."""
    env = {"CUDA_VISIBLE_DEVICES": "" if fake else gpu, "VLMQ_DEVICE": "cpu" if fake else "cuda:0"}
    if settings.metrics_port:
        env["VLMQ_METRICS_PORT"] = str(settings.metrics_port + index)
    return env


def main_from_args(args: argparse.Namespace) -> int:
    from vlmq.workers import logs, native

    STARTUP.mark("interpreter and CLI")
    native.configure_native_pools()  # before torch loads
    native.fix_mmap_threshold()

    overrides = {k: v for k, v in (("device", args.device), ("worker_classes", args.classes),
                                   ("worker_budget", args.budget), ("worker_batch", args.batch),
                                   ("backend", args.backend), ("log_format", args.log_format),
                                   ("speculative", args.speculative)) if v is not None}
    settings = Settings.from_env(**overrides)
    name = args.name or default_name()
    logs.configure(settings.log_format, "supervisor:" + name if args.gpus else name)
    if args.gpus:
        return run_gpu_workers(settings, args.model, args.gpus)
    return run_worker(settings, args.model, name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vlmq worker")
    add_worker_arguments(parser)
    return main_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
