"""Queue benchmark: vlmq submit rates and per-job queue overhead against plain Celery, same server, same run.

Starts an embedded Redis-compatible server and measures, in one process run:
  submit    plain Celery apply_async/s and vlmq single submit/s (each storing a new input), in alternating
            blocks; vlmq bulk submit_many/s with inputs already stored and with new inputs; several producer
            processes submitting at once
  drain     every job through CPU worker(s), none lost
  overhead  alternating unloaded round trips: a plain Celery task (send -> result) and a vlmq job, whose
            overhead is its submit -> result latency minus the model's own time
Alternating keeps the ratios fair on a machine whose load drifts. ``--storage-dir`` puts the file:// store
on another disk (e.g. /dev/shm, to separate the queue path from a shared disk's fsync latency).
Prints a table and writes JSON (default bench-results/queue.json).
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from PIL import Image

from vlmq import keys
from vlmq.client import Client
from vlmq.embedded import start_valkey
from vlmq.settings import Settings

PROMPT = "How many shapes?"


def tiny_png(i: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (56 + i % 16, 56), (i % 256, (i // 256) % 256, 9)).save(buf, "PNG")
    return buf.getvalue()


def baseline_app(broker: str):
    from celery import Celery

    app = Celery("bench", broker=broker, backend=broker)
    app.conf.update(task_serializer="json", accept_content=["json"], result_serializer="json",
                    worker_hijack_root_logger=False)

    @app.task(name="bench.noop")
    def noop(x: int) -> int:
        return x

    return app


def run_baseline_worker(broker: str) -> None:
    baseline_app(broker).worker_main(["worker", "--pool", "threads", "--concurrency", "4", "--loglevel", "WARNING",
                                      "--without-gossip", "--without-mingle", "--without-heartbeat", "-Q", "bench"])


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def interleaved_submits(app, client: Client, n: int, rounds: int) -> tuple[float, float]:
    """apply_async/s and single submit/s, measured in alternating blocks so load drift hits both alike."""
    spent = {"celery": 0.0, "vlmq": 0.0}
    per = n // rounds
    images = [tiny_png(i) for i in range(per * rounds)]
    for r in range(rounds):
        t0 = time.perf_counter()
        for i in range(per):
            app.send_task("bench.noop", args=[i], queue="bench-unconsumed")
        t1 = time.perf_counter()
        for data in images[r * per:(r + 1) * per]:
            client.submit(data, PROMPT, max_new_tokens=1)
        spent["celery"] += t1 - t0
        spent["vlmq"] += time.perf_counter() - t1
    return per * rounds / spent["celery"], per * rounds / spent["vlmq"]


def interleaved_trips(app, client: Client, trips: int) -> tuple[list[float], list[float], list[float]]:
    """Alternating unloaded round trips: a plain Celery task (ms), and a vlmq job (latency and overhead, ms)."""
    app.send_task("bench.noop", args=[0], queue="bench").get(timeout=120)  # warm up
    client.submit(tiny_png(10**6 - 1), PROMPT, max_new_tokens=1).result(timeout=120)
    rtts, latencies, overheads = [], [], []
    for i in range(trips):
        t = time.perf_counter()
        app.send_task("bench.noop", args=[i], queue="bench").get(timeout=60)
        rtts.append((time.perf_counter() - t) * 1000)
        t = time.perf_counter()
        result = client.submit(tiny_png(10**6 + i), PROMPT, max_new_tokens=1).result(timeout=60)
        latencies.append((time.perf_counter() - t) * 1000)
        overheads.append(latencies[-1] - result.timings["model"] * 1000)
    return rtts, latencies, overheads


def producer(settings: Settings, offset: int, n: int, out: mp.Queue) -> None:
    with Client(settings=settings) as client:
        t0 = time.perf_counter()
        ids = [client.submit(tiny_png(offset + i), PROMPT, max_new_tokens=1).id for i in range(n)]
        out.put((ids, time.perf_counter() - t0))


def start_worker(settings: Settings, log: Path, batch: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, **settings.to_env(), "VLMQ_WORKER_BATCH": str(batch)}
    with open(log, "wb") as f:
        return subprocess.Popen([sys.executable, "-m", "vlmq.workers.main"], env=env, stdout=f,
                                stderr=subprocess.STDOUT)


def wait_ready(log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while " ready." not in log.read_text(errors="replace"):
        if time.monotonic() > deadline:
            raise TimeoutError(log.read_text()[-2000:])
        time.sleep(0.2)


def bench(broker: str, settings: Settings, n: int, producers: int, workers: int, trips: int,
          tmp: Path) -> tuple[dict[str, float], dict[str, float]]:
    base: dict[str, float] = {}
    res: dict[str, float] = {}
    app = baseline_app(broker)
    with Client(settings=settings) as client:
        base["submits_per_s"], res["single_submits_per_s"] = interleaved_submits(app, client, n, 4)
        images = [tiny_png(n + i) for i in range(n)]
        for data in images:  # "inputs already stored": what the floor compares with plain Celery
            client.storage.put(keys.input_object(hashlib.sha256(data).hexdigest()), data)
        batch = [{"image": data, "prompt": PROMPT, "max_new_tokens": 1} for data in images]
        t0 = time.perf_counter()
        for k in range(0, n, 500):
            client.submit_many(batch[k:k + 500])
        res["bulk_submits_per_s"] = n / (time.perf_counter() - t0)
        fresh = [{"image": tiny_png(5 * n + i), "prompt": PROMPT, "max_new_tokens": 1} for i in range(n)]
        t0 = time.perf_counter()
        for k in range(0, n, 500):
            client.submit_many(fresh[k:k + 500])
        res["bulk_fresh_inputs_submits_per_s"] = n / (time.perf_counter() - t0)
        all_ids = [j.decode().removeprefix(keys.job("")) for j in client.redis.keys(keys.job("*"))]
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    per = n // producers
    procs = [ctx.Process(target=producer, args=(settings, 2 * n + p * per, per, out)) for p in range(producers)]
    for p in procs:
        p.start()
    parts = [out.get(timeout=600) for _ in procs]
    # each producer times its own submits (process start-up and imports excluded)
    res[f"{producers}_producers_submits_per_s"] = producers * per / max(elapsed for _, elapsed in parts)
    all_ids += [i for ids, _ in parts for i in ids]
    logs = [tmp / f"worker{i}.log" for i in range(workers)]
    procs_w = [start_worker(settings, log, 32) for log in logs]
    baseline_worker = subprocess.Popen([sys.executable, __file__, "--baseline-worker", broker])
    try:
        for log in logs:
            wait_ready(log)
        t0 = time.perf_counter()
        with Client(settings=settings) as client:
            for job_id in all_ids:
                client.job(job_id).result(timeout=1800)
            res["drained_jobs"] = len(all_ids)
            res["drain_jobs_per_s"] = len(all_ids) / (time.perf_counter() - t0)
            res["lost_jobs"] = sum(client.job(i).status().value != "finished" for i in all_ids)
            rtts, latencies, overheads = interleaved_trips(app, client, trips)
        base["round_trip_ms_p50"], base["round_trip_ms_p99"] = statistics.median(rtts), pct(rtts, 0.99)
        res["e2e_latency_ms_p50"] = statistics.median(latencies)
        res["queue_overhead_ms_p50"] = statistics.median(overheads)
        res["queue_overhead_ms_p99"] = pct(overheads, 0.99)
    finally:
        for w in [*procs_w, baseline_worker]:
            w.terminate()
            w.wait()
    return base, res


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--baseline-worker":
        run_baseline_worker(sys.argv[2])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2000, help="jobs per submit mode (four modes: total 4x)")
    parser.add_argument("--producers", type=int, default=4)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--trips", type=int, default=50)
    parser.add_argument("--out", default="bench-results/queue.json")
    parser.add_argument("--storage-dir", default=None,
                        help="folder for the file:// store (default: a new temporary folder)")
    args = parser.parse_args()
    server = start_valkey()
    tmp = Path(tempfile.mkdtemp(prefix="vlmq-bench-"))
    try:
        store = Path(args.storage_dir or tmp) / "store"
        settings = Settings(broker_url=server.url, storage_url=f"file://{store}")
        base, ours = bench(server.url, settings, args.jobs, args.producers, args.workers, args.trips, tmp)
    finally:
        server.stop()
    report = {"baseline_celery": base, "vlmq": ours, "jobs_per_mode": args.jobs, "cpus": os.cpu_count(),
              "workers": args.workers, "producers": args.producers, "storage": str(store),
              "date": time.strftime("%Y-%m-%d"),
              "ratios": {"single_submit_vs_celery": ours["single_submits_per_s"] / base["submits_per_s"],
                         "bulk_submit_vs_celery": ours["bulk_submits_per_s"] / base["submits_per_s"],
                         "overhead_vs_celery_round_trip": ours["queue_overhead_ms_p50"] / base["round_trip_ms_p50"]}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"{'measure':<40} {'value':>12}")
    for group, values in (("celery", base), ("vlmq", ours), ("ratio", report["ratios"])):
        for k, v in values.items():
            print(f"{group + ' ' + k:<40} {v:>12.2f}")


if __name__ == "__main__":
    main()
