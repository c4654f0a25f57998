"""Worker pace benchmark: a 128-token job through a worker, against the engine alone, before and after passes of
the hostile-image corpus.

    python scripts/bench_worker_pace.py [--passes 3] [--alone 7] [--variants shipped,none]

Starts an embedded Redis-compatible server, a file:// store and one CPU worker (tiny-shapes) per variant:

- ``shipped``: the worker as shipped (workers/native.py: the model thread owns the only OpenMP team, whose
  threads sleep between parallel regions, and glibc's mmap threshold stays fixed at 4 MiB);
- ``no-passive``: the same with libgomp's default wait policy (team threads spin, then sleep);
- ``no-mmap-fix``: the same with glibc's own (rising) mmap threshold; ``mmap-128k``: fixed at 128 KiB instead;
- ``none``: every part of native.py switched off (model loaded on the main thread, every pool thread with torch's
  default OpenMP thread count), as the worker was before it.

Per round it times, interleaved: ``--alone`` runs of the same request (128 tokens, ignore_eos) through
``Engine.generate`` in this process (the engine the worker builds, on a thread of its own, with the worker's OpenMP
wait policy), then the same number of jobs through each worker one after another; then one pass of the corpus
through each worker (tests/hostile_images.py; what the SDK refuses is forged past it, as the e2e test does).
Reports per round and variant the median job time, its ratio to the engine alone, the busiest worker thread's
context switches per job (an OpenMP team whose threads sleep between parallel regions shows here) and the worker's
resident memory; writes JSON (``--out``).
"""
from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "e2e")]

from vlmq.workers import native  # noqa: E402

_USER_WAIT_POLICY = "OMP_WAIT_POLICY" in os.environ
native.configure_native_pools()  # the engine alone here waits for work as the shipped worker's does
import torch  # noqa: E402, F401  (libgomp reads the policy as it loads)

if not _USER_WAIT_POLICY:  # each worker variant sets its own (or not)
    del os.environ["OMP_WAIT_POLICY"]

import inputs  # noqa: E402
from hostile_images import CASES  # noqa: E402
from test_hostile_images_e2e import PROMPT, Forger  # noqa: E402
from workerproc import TINY_CLASSES, WorkerProcess  # noqa: E402

from vlmq.client import Client  # noqa: E402
from vlmq.embedded import start_valkey  # noqa: E402
from vlmq.errors import InvalidRequest, JobFailed  # noqa: E402
from vlmq.settings import Settings  # noqa: E402

TOKENS = 128


def patched(*names: str) -> str:
    """A worker entry with these workers/native.py functions switched off."""
    offs = "; ".join(f"native.{n} = lambda *a, **k: None" for n in names if n != "on_own_thread")
    own = "; native.on_own_thread = lambda call, name='': call()" if "on_own_thread" in names else ""
    return (f"import sys; from vlmq.workers import native; {offs}{own}; from vlmq.workers.main import main; "
            "sys.exit(main(sys.argv[1:]))")


VARIANTS = {  # name -> (worker environment, worker entry code or None for the shipped worker)
    "shipped": ({}, None),
    "no-passive": ({}, patched("configure_native_pools")),  # the rule with libgomp's default wait (spin, then sleep)
    "no-mmap-fix": ({}, patched("fix_mmap_threshold")),
    "mmap-128k": ({"MALLOC_MMAP_THRESHOLD_": str(128 << 10)}, patched("fix_mmap_threshold")),  # glibc's start
    "none": ({"TOKENIZERS_PARALLELISM": "true"},
             patched("configure_native_pools", "fix_mmap_threshold", "use_openmp_threads", "on_own_thread")),
}


def normal(client: Client) -> float:
    start = time.monotonic()
    client.submit(inputs.encode(inputs.rgb(), "PNG"), PROMPT, max_new_tokens=TOKENS, ignore_eos=True).result(
        timeout=300)
    return time.monotonic() - start


def corpus_pass(client: Client, forger: Forger) -> None:
    jobs = []
    for case in CASES:
        try:
            jobs.append(client.submit(case.data(), PROMPT, max_new_tokens=8))
        except InvalidRequest:
            jobs.append(forger.submit(case.data()))
    for job in jobs:
        try:
            job.result(timeout=300)
        except JobFailed:
            pass


def rss_mb(pid: int) -> float:
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmRSS"))
    return int(line.split()[1]) / 1024


def switches(pid: int) -> dict[int, int]:
    """Thread id -> voluntary context switches, for each thread of the worker."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except OSError:  # the thread ended
            continue
        out[int(tid)] = int(next(x for x in status.splitlines() if x.startswith("voluntary_ctxt")).split()[1])
    return out


def alone(client: Client, pid: int, n: int) -> tuple[float, float]:
    """Median seconds of ``n`` normal jobs, and the busiest thread's context switches per job."""
    before = switches(pid)
    times = [normal(client) for _ in range(n)]
    after = switches(pid)
    most = max(v - before.get(tid, 0) for tid, v in after.items())
    return statistics.median(times), most / n


class EngineAlone:
    """The engine the worker builds (same backend arguments), driven by Engine.generate on one thread of its own."""

    def __init__(self, settings: Settings) -> None:
        from PIL import Image

        from vlmq.models import resolve_model
        from vlmq.workers.backends import load_backend
        from vlmq.workers.kvstore import store_from_settings
        from vlmq.workers.main import model_dir
        from vlmq.workers.native import ALL, thread_pool

        spec = resolve_model("tiny-shapes", settings)
        self.thread = thread_pool(1, "vlmq-bench-engine", omp_threads=ALL)
        kv_store = store_from_settings(settings, spec.name, model_dir(spec), None)
        self.backend = self.thread.submit(lambda: load_backend(
            "engine", model_dir(spec), "cpu", kv_tokens=settings.worker_budget, kv_store=kv_store,
            speculative=settings.speculative or "model")).result()
        self.image = Image.open(io.BytesIO(inputs.encode(inputs.rgb(), "PNG"))).convert("RGB")

    def one(self) -> float:
        from vlmq.workers.engine.engine import Request

        def run() -> float:
            start = time.monotonic()
            (out,) = self.backend.engine.generate([Request(self.image, PROMPT, TOKENS, True)])
            assert len(out.token_ids) == TOKENS
            return time.monotonic() - start

        return self.thread.submit(run).result()

    def median(self, n: int) -> float:
        return statistics.median(self.one() for _ in range(n))


def start_workers(names: list[str], url: str, tmp: str) -> dict[str, tuple[Settings, WorkerProcess]]:
    out = {}
    for db, name in enumerate(names, start=1):
        env, code = VARIANTS[name]
        settings = Settings(broker_url=f"{url.rsplit('/', 1)[0]}/{db}", storage_url=f"file://{tmp}/store-{db}",
                            cost_classes=TINY_CLASSES)
        entry = ("-c", code) if code else ("-m", "vlmq.workers.main")
        out[name] = settings, WorkerProcess(settings, Path(tmp) / f"{name}.log", entry=entry, env=env)
    for _, worker in out.values():
        worker.wait_ready()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--alone", type=int, default=7)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--out", default="bench-results/worker-pace.json")
    args = parser.parse_args()
    names = args.variants.split(",")
    server = start_valkey()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        workers = start_workers(names, server.url, tmp)
        clients = {n: Client(settings=s) for n, (s, _) in workers.items()}
        try:
            engine = EngineAlone(workers[names[0]][0])
            forgers = {}
            for name, client in clients.items():
                warm = client.submit(inputs.encode(inputs.rgb(), "PNG"), PROMPT, max_new_tokens=4)
                warm.result(timeout=300)
                forgers[name] = Forger(client, workers[name][0], warm.id)
            engine.one()  # warm-up
            for round_ in range(args.passes + 1):
                eng = engine.median(args.alone)
                print(f"after {round_} passes: engine alone {eng:.3f} s", flush=True)
                for name, client in clients.items():
                    pid = workers[name][1].proc.pid
                    median, per_job = alone(client, pid, args.alone)
                    rows.append({"variant": name, "passes_before": round_, "engine_alone_s": round(eng, 3),
                                 "job_median_s": round(median, 3), "job_over_engine": round(median / eng, 2),
                                 "context_switches_per_job": round(per_job), "rss_mb": round(rss_mb(pid))})
                    print(f"  {name:14s} job {median:.3f} s = {median / eng:.2f}x engine, {per_job:.0f} context "
                          f"switches per job, worker RSS {rss_mb(pid):.0f} MB", flush=True)
                if round_ < args.passes:
                    for name, client in clients.items():
                        corpus_pass(client, forgers[name])
            for forger in forgers.values():
                forger.close()
        finally:
            for client in clients.values():
                client.close()
            for _, worker in workers.values():
                worker.stop()
            server.stop()
    summary = {}
    for name in names:
        mine = [r for r in rows if r["variant"] == name]
        summary[name] = {"worst_job_over_engine": max(r["job_over_engine"] for r in mine),
                         "rss_last_over_first": round(mine[-1]["rss_mb"] / mine[0]["rss_mb"], 2)}
        print(f"{name:14s} worst job/engine {summary[name]['worst_job_over_engine']:.2f}x, RSS last/first "
              f"{summary[name]['rss_last_over_first']:.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "command": " ".join(sys.argv),
        "alone_runs": args.alone, "tokens": TOKENS, "rounds": rows, "summary": summary}, indent=2) + "\n")


if __name__ == "__main__":
    main()
